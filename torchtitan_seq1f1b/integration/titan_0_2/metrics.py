# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan metrics with Seq1F1B's own per-step figures added, and one
console line per logged step."""

import contextlib
import copy
import logging
from collections import deque
from typing import Any

import torch.distributed as dist

from torchtitan.components.metrics import _get_metrics_rank, MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import BaseModelArgs

from torchtitan_seq1f1b.integration.metrics import Seq1F1BFigures
from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["Seq1F1BMetricsProcessor", "build_seq1f1b_metrics_processor"]


class Seq1F1BMetricsProcessor(MetricsProcessor):
    """Adds :class:`Seq1F1BFigures` once a Seq1F1B schedule is attached
    (every rank calls ``log``, as the figures need).

    With pipelining only the last stage has the loss; torchtitan prints the
    step line on every rank, with loss -1 where it is missing. When
    ``prints_loss`` is False (Seq1F1B jobs, on every rank but the one
    torchtitan picks to write metrics) the step and validation lines are not
    printed. ``recent_losses`` keeps the last logged losses of this rank; the
    last step is always logged.
    """

    schedule: ScheduleSeq1F1B | None = None
    _figures: Seq1F1BFigures | None = None

    def __init__(
        self,
        job_config: JobConfig,
        parallel_dims: ParallelDims,
        tag: str | None = None,
        prints_loss: bool = True,
    ):
        super().__init__(job_config, parallel_dims, tag)
        self.prints_loss = prints_loss
        self.recent_losses: deque[float] = deque(maxlen=10)

    def should_log(self, step: int) -> bool:
        """torchtitan's rule, plus the last step, whose loss the run summary reports."""
        return super().should_log(step) or step == self.job_config.training.steps

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        metrics = dict(extra_metrics or {})
        if self.schedule is not None:
            if self._figures is None or self._figures.schedule is not self.schedule:
                self._figures = Seq1F1BFigures(self.schedule)
            metrics.update(self._figures.step_metrics())
        self.recent_losses.append(global_avg_loss)
        with self._console():
            super().log(step, global_avg_loss, global_max_loss, grad_norm, metrics)

    def log_validation(
        self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None
    ):
        with self._console():
            super().log_validation(loss, step, extra_metrics)

    def _console(self) -> contextlib.AbstractContextManager:
        """Where ``prints_loss`` is False, hold back INFO lines (warnings still show)."""
        return contextlib.nullcontext() if self.prints_loss else _logging_level(logging.WARNING)


def build_seq1f1b_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: BaseModelArgs | None = None,
    tag: str | None = None,
) -> Seq1F1BMetricsProcessor:
    entry = SCHEDULES.get(job_config.parallelism.pipeline_parallel_schedule)
    if entry is not None and entry.layout_of == "ZBVZeroBubble":
        # torchtitan picks the rank that writes metrics by schedule name; its
        # rule for ZBVZeroBubble (rank 0 holds the last stage) is the V's.
        job_config = copy.copy(job_config)
        job_config.parallelism = copy.copy(job_config.parallelism)
        job_config.parallelism.pipeline_parallel_schedule = entry.layout_of
    prints_loss = (
        entry is None
        or not parallel_dims.pp_enabled
        or dist.get_rank() == _get_metrics_rank(parallel_dims, job_config)
    )
    return Seq1F1BMetricsProcessor(job_config, parallel_dims, tag, prints_loss)


@contextlib.contextmanager
def _logging_level(level: int):
    root = logging.getLogger()
    saved = root.level
    root.setLevel(max(saved, level))
    try:
        yield
    finally:
        root.setLevel(saved)

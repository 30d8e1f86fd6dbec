# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan metrics with Seq1F1B's own per-step figures added."""

import copy
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import BaseModelArgs

from torchtitan_seq1f1b.integration.pipeline import SCHEDULES
from torchtitan_seq1f1b.schedule import ScheduleSeq1F1B
from torchtitan_seq1f1b.simulate import equal_cost_bubble

__all__ = ["Seq1F1BMetricsProcessor", "build_seq1f1b_metrics_processor"]


class Seq1F1BMetricsProcessor(MetricsProcessor):
    """Adds, under ``seq1f1b/``, once a Seq1F1B schedule is attached:

    - ``segment_len/<j>``: the plan's segment lengths (tokens);
    - ``kv_store_peak_bytes``: the largest K/V store of the logged step over
      all pipeline stages (the first stage's, normally);
    - ``bubble_estimate``: the idle fraction of the schedule's order when all
      units cost the same (``(p-1) / (m*k + p-1)`` for Seq1F1B).

    Every rank calls ``log``, so the pipeline-wide maximum is one all-reduce.
    """

    schedule: ScheduleSeq1F1B | None = None
    _bubble_estimate: float | None = None

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
            metrics.update(self._seq1f1b_metrics(self.schedule))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, metrics)

    def _seq1f1b_metrics(self, schedule: ScheduleSeq1F1B) -> dict[str, float]:
        stage = schedule._stages[0]
        peak = torch.tensor(
            [max(store.peak_bytes for store in schedule.kv_stores.values())],
            dtype=torch.int64,
            device=stage.device,
        )
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=stage.group)
        if self._bubble_estimate is None:
            self._bubble_estimate = equal_cost_bubble(
                schedule.segment_order, schedule.num_segments, len(schedule._stages)
            )
        metrics = {
            f"seq1f1b/segment_len/{j}": length
            for j, length in enumerate(schedule.segment_plan.lengths)
        }
        metrics["seq1f1b/kv_store_peak_bytes"] = int(peak.item())
        metrics["seq1f1b/bubble_estimate"] = self._bubble_estimate
        return metrics


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
    return Seq1F1BMetricsProcessor(job_config, parallel_dims, tag)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3 metrics with Seq1F1B's per-step figures added."""

from collections import deque
from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from torchtitan_seq1f1b.integration.metrics import Seq1F1BFigures

__all__ = ["Seq1F1BMetricsProcessor"]


class Seq1F1BMetricsProcessor(MetricsProcessor):
    """Logs :class:`Seq1F1BFigures` too once :attr:`figures` is set
    (:class:`~.trainer.Seq1F1BTrainer` sets it for Seq1F1B jobs); every
    rank calls ``log``, as the figures need. ``recent_losses`` keeps this
    rank's last logged losses for the run summary (-1 where the rank holds
    no loss)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    figures: Seq1F1BFigures | None = None

    def __init__(self, config: Config, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.recent_losses: deque[float] = deque(maxlen=10)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        metrics = dict(extra_metrics or {})
        self.recent_losses.append(global_avg_loss)
        if self.figures is not None:
            metrics.update(self.figures.step_metrics())
        super().log(step, global_avg_loss, global_max_loss, grad_norm, metrics)

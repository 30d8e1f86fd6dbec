# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B's per-step figures, which every adapter's metrics processor logs."""

import torch
import torch.distributed as dist

from torchtitan_seq1f1b.orders import equal_cost_bubble
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["Seq1F1BFigures"]


class Seq1F1BFigures:
    """Under ``seq1f1b/``, for a schedule:

    - ``segment_len/<j>``: the plan's segment lengths (tokens);
    - ``kv_store_peak_bytes``: the largest K/V store of the logged step over
      all pipeline stages (the first stage's, normally);
    - ``bubble_estimate``: the idle fraction of the schedule's order when all
      units cost the same (``(p-1) / (m*k + p-1)`` for Seq1F1B).

    Every pipeline rank must call :meth:`step_metrics` together: the
    pipeline-wide maximum is one all-reduce.
    """

    def __init__(self, schedule: ScheduleSeq1F1B):
        self.schedule = schedule
        self.bubble_estimate = equal_cost_bubble(
            schedule.segment_order, schedule.num_segments, len(schedule._stages)
        )

    def step_metrics(self) -> dict[str, float]:
        schedule = self.schedule
        stage = schedule._stages[0]
        peak = torch.tensor(
            [max(store.peak_bytes for store in schedule.kv_stores.values())],
            dtype=torch.int64,
            device=stage.device,
        )
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=stage.group)
        metrics = {
            f"seq1f1b/segment_len/{j}": length
            for j, length in enumerate(schedule.segment_plan.lengths)
        }
        metrics["seq1f1b/kv_store_peak_bytes"] = int(peak.item())
        metrics["seq1f1b/bubble_estimate"] = self.bubble_estimate
        return metrics

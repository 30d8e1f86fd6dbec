# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One rank's side of a short pipeline the planner's probes step on local CPU ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["ProbePipeline", "probe_pipeline"]


@dataclass
class ProbePipeline:
    """A Seq1F1B schedule (or a variant) over one rank's stages, with the batch it steps on."""

    schedule: ScheduleSeq1F1B
    stages: list[PipelineStage]
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor | None
    last_stage: int

    def step(self) -> None:
        self.schedule.step(*self.inputs, target=self.target, return_outputs=False)


def probe_pipeline(
    schedule_cls: type[ScheduleSeq1F1B],
    rank: int,
    world_size: int,
    stages_per_rank: int,
    microbatches: int,
    plan: SegmentPlan,
    stage_module: Callable[[int, int], nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: tuple[int, int],
    dtype: torch.dtype,
    vocab_size: int = 1,
) -> ProbePipeline:
    """Build ``rank``'s stages (read from ``schedule_cls``'s own order) and its schedule.

    ``stage_module(stage index, number of stages)`` makes a stage's module. The
    first stage's rank gets hidden states (microbatches * batch, seq_len, dim)
    for ``hidden`` = (batch, dim); the last stage's rank token targets below
    ``vocab_size``.
    """
    num_stages = world_size * stages_per_rank
    order = schedule_cls.order_for(world_size, stages_per_rank, microbatches, plan.num_segments)
    indices = sorted({action.stage for action in order[rank]})
    stages = [
        PipelineStage(stage_module(i, num_stages).to(dtype), i, num_stages, torch.device("cpu"))
        for i in indices
    ]
    schedule = schedule_cls(
        stages, microbatches, plan, loss_fn=loss_fn, positions_kwarg="positions"
    )
    batch, dim = hidden
    rows = microbatches * batch
    inputs = (torch.randn(rows, plan.seq_len, dim, dtype=dtype),) if 0 in indices else ()
    last = num_stages - 1
    target = torch.randint(0, vocab_size, (rows, plan.seq_len)) if last in indices else None
    return ProbePipeline(schedule, stages, inputs, target, last)

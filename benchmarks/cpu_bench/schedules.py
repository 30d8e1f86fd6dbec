# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The schedules the benchmark runs: class, stages per rank, placement, constraints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from torchtitan_seq1f1b.schedules import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)

__all__ = ["BenchSchedule", "SCHEDULES"]


def _microbatches_at_least_pp(pp: int, microbatches: int) -> str | None:
    if microbatches < pp:
        return f"needs microbatches >= pp ({microbatches} < {pp})"
    return None


def _whole_rounds(pp: int, microbatches: int) -> str | None:
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return f"needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}"
    return None


@dataclass(frozen=True)
class BenchSchedule:
    """One schedule the benchmark can run.

    Args:
        name: row label; also the schedule's name in the simulator, which
            predicts the rows whose name it lists in ``simulate.SCHEDULES``.
        schedule_cls: the schedule class.
        stages_per_rank: model chunks per rank (v); the model is cut into
            ``pp * stages_per_rank`` stages of equal layer counts.
        placement: "loop" (rank r holds stages r, r + pp, ...) or "v" (rank r
            holds r and 2 pp - 1 - r, as ZBV needs).
        segmented: a Seq1F1B schedule, built with a SegmentPlan.
        default_segments: k values run when ``--segments`` is not given.
        constraint: ``constraint(pp, microbatches)`` -> why the schedule
            rejects that layout, or None.
    """

    name: str
    schedule_cls: type
    stages_per_rank: int = 1
    placement: str = "loop"
    segmented: bool = False
    default_segments: tuple[int, ...] = (1,)
    constraint: Callable[[int, int], str | None] | None = None

    def stage_indices(self, rank: int, pp: int) -> list[int]:
        if self.placement == "v":
            return [rank, 2 * pp - 1 - rank]
        return [rank + chunk * pp for chunk in range(self.stages_per_rank)]


SCHEDULES: dict[str, BenchSchedule] = {
    spec.name: spec
    for spec in (
        BenchSchedule("1F1B", Schedule1F1B, constraint=_microbatches_at_least_pp),
        BenchSchedule("GPipe", ScheduleGPipe),
        BenchSchedule(
            "Interleaved1F1B", ScheduleInterleaved1F1B, stages_per_rank=2,
            constraint=_whole_rounds,
        ),
        BenchSchedule("LoopedBFS", ScheduleLoopedBFS, stages_per_rank=2),
        BenchSchedule("ZBVZeroBubble", ScheduleZBVZeroBubble, stages_per_rank=2, placement="v"),
        BenchSchedule(
            "Seq1F1B", ScheduleSeq1F1B, segmented=True, default_segments=(1, 2, 4, 8)
        ),
        BenchSchedule(
            "InterleavedSeq1F1B", ScheduleInterleavedSeq1F1B, stages_per_rank=2,
            segmented=True, default_segments=(1, 2, 4),
        ),
        BenchSchedule(
            "Seq1F1BZeroBubble", ScheduleSeq1F1BZeroBubble, segmented=True,
            default_segments=(1, 2, 4),
        ),
        BenchSchedule(
            "Seq1F1BZBV", ScheduleSeq1F1BZBV, stages_per_rank=2, placement="v",
            segmented=True, default_segments=(1, 2, 4),
        ),
    )
}

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Checks of a schedule's arguments and of where its stages sit, before any collective.

Every rank runs them in the constructor, so a bad layout fails on every rank
with the fix named instead of hanging in the first send.
"""

from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b.context_parallel import HeadTail
from torchtitan_seq1f1b.segmenting import nearest_aligned, SegmentPlan

__all__ = [
    "check_loop_placement",
    "check_one_stage_per_rank",
    "check_plan",
    "check_v_placement",
]


def check_plan(n_microbatches: int, segment_plan: SegmentPlan) -> None:
    """Reject a bad plan or microbatch count before any collective runs."""
    if not isinstance(segment_plan, SegmentPlan):
        raise TypeError(
            f"segment_plan must be a SegmentPlan, got {type(segment_plan).__name__}; "
            "build one with SegmentPlan.uniform or SegmentPlan.balanced"
        )
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1")


def check_context_parallel_plan(segment_plan: SegmentPlan, layout: HeadTail) -> None:
    """Reject segment lengths that context parallelism cannot cut into head-tail pieces,
    naming the nearest that it can."""
    pieces = layout.pieces
    if all(n % pieces == 0 for n in segment_plan.lengths):
        return
    nearest = nearest_aligned(segment_plan.lengths, pieces)
    raise ValueError(
        f"segment lengths {list(segment_plan.lengths)} cannot be cut into 2 * {layout.degree} "
        f"head-tail pieces for context parallelism of degree {layout.degree}: each must be a "
        f"multiple of {pieces}, e.g. {nearest}, or a plan built "
        f"with align={pieces}"
    )


def check_one_stage_per_rank(stages: list[_PipelineStageBase], schedule: str) -> None:
    if len(stages) != 1:
        raise ValueError(
            f"{schedule} runs one stage per rank but got {len(stages)} stages; "
            "use ScheduleInterleavedSeq1F1B for several stages per rank"
        )
    stage = stages[0]
    if stage.num_stages != stage.group_size:
        raise ValueError(
            f"{schedule} needs num_stages == pipeline group size; got "
            f"{stage.num_stages} stages on {stage.group_size} ranks"
        )


def check_loop_placement(stages: list[_PipelineStageBase], schedule: str) -> None:
    if len(stages) < 2:
        raise ValueError(
            f"{schedule} needs at least 2 stages per rank, got {len(stages)}; "
            "use ScheduleSeq1F1B for one stage per rank"
        )
    first = stages[0]
    ranks, rank = first.group_size, first.group_rank
    expected = [rank + chunk * ranks for chunk in range(len(stages))]
    if first.num_stages != len(stages) * ranks or [
        s.stage_index for s in stages
    ] != expected:
        raise ValueError(
            f"{schedule} places stages in a loop: with {ranks} ranks and "
            f"{len(stages)} stages per rank, rank {rank} must hold stages {expected} "
            f"of {len(stages) * ranks}; got stages "
            f"{[s.stage_index for s in stages]} of {first.num_stages}"
        )


def check_v_placement(stages: list[_PipelineStageBase], schedule: str) -> None:
    first = stages[0]
    ranks, rank = first.group_size, first.group_rank
    expected = [rank, 2 * ranks - 1 - rank]
    if [s.stage_index for s in stages] != expected or first.num_stages != 2 * ranks:
        raise ValueError(
            f"{schedule} places two stages per rank in a V: with {ranks} "
            f"ranks, rank {rank} must hold stages {expected} of {2 * ranks}; got "
            f"stages {[s.stage_index for s in stages]} of {first.num_stages}"
        )

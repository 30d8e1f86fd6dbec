# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The schedules the simulator knows: order generators, stages per rank, closed-form bubbles.

p ranks, v stages (model chunks) per rank, m microbatches, k segments per
microbatch. Which real schedule each name runs, and where its closed form is
exact: docs/simulator.md, "Schedules" and "Timeline model".
"""

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_seq1f1b._torch_compat.introspection import torch_schedule_order
from torchtitan_seq1f1b.actions import Order, SegmentAction
from torchtitan_seq1f1b.orders import (
    gpipe_order,
    interleaved_seq1f1b_order,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
)

__all__ = ["SCHEDULES", "SCHEDULE_SPECS", "ScheduleSpec", "analytic_bubble"]


def _torch_order(schedule_name: str) -> Callable[[int, int, int, int], Order]:
    """Order generator of torch's multi-stage schedule ``schedule_name`` (k = 1)."""

    def order(ranks: int, chunks: int, n_microbatches: int, num_segments: int) -> Order:
        actions = torch_schedule_order(schedule_name, ranks, chunks, n_microbatches)
        return {
            rank: [SegmentAction.from_action(a, num_segments) for a in rank_actions]
            for rank, rank_actions in actions.items()
        }

    return order


def analytic_bubble(
    num_stages: int, n_microbatches: int, num_segments: int = 1, chunks: int = 1
) -> float:
    """Bubble fraction of the 1F1B family with equal-cost units, p = ``num_stages`` ranks.

    ``(p-1) / (v*m*k + p-1)``: 1F1B and GPipe (k = v = 1), Seq1F1B (v = 1),
    interleaved 1F1B (k = 1) and Seq1F1B-I, and LoopedBFS (k = 1).
    """
    return (num_stages - 1) / (chunks * n_microbatches * num_segments + num_stages - 1)


def _zero_bubble_analytic(ranks: int, chunks: int, n_microbatches: int, num_segments: int):
    """``(p-1) / (3*v*m*k + p-1)``: with F = I = W every rank idles (p-1) unit forwards."""
    return (ranks - 1) / (3 * chunks * n_microbatches * num_segments + ranks - 1)


@dataclass(frozen=True)
class ScheduleSpec:
    """What the simulator needs to know about a named schedule.

    Args:
        order: ``order(ranks, chunks, microbatches, segments)`` -> per-rank
            actions: the generator the real schedule runs.
        segmented: cuts microbatches into k segments (otherwise k = 1).
        analytic: ``analytic(ranks, chunks, microbatches, segments)``, the
            bubble fraction with equal-cost units where a closed form is
            exact, else None.
        min_chunks, max_chunks: allowed stages per rank (``max_chunks=None``:
            no upper limit). The default is ``min_chunks``.
    """

    order: Callable[[int, int, int, int], Order]
    segmented: bool
    analytic: Callable[[int, int, int, int], float | None]
    min_chunks: int = 1
    max_chunks: int | None = 1

    @property
    def multi_stage(self) -> bool:
        return self.min_chunks > 1

    def chunks_problem(self, name: str, chunks: int) -> str | None:
        """Why this schedule cannot run ``chunks`` stages per rank, with the fix; else None."""
        if self.min_chunks <= chunks and (self.max_chunks is None or chunks <= self.max_chunks):
            return None
        if self.max_chunks == 1:
            multi = ", ".join(n for n, s in SCHEDULE_SPECS.items() if s.multi_stage)
            return f"{name} runs one stage per rank; use 1, or an interleaved schedule ({multi})"
        if self.max_chunks == self.min_chunks:
            return f"{name} runs exactly {self.min_chunks} stages per rank; use {self.min_chunks}"
        return f"{name} runs several stages (model chunks) per rank; use {self.min_chunks} or more"


# Where the closed forms are exact (checked by tests/tools/test_simulate.py): 1F1B, GPipe
# and Seq1F1B always; interleaved rounds need m*k >= p units (LoopedBFS: m >= p);
# Seq1F1BZeroBubble needs steady state on every rank, m*k >= p + k - 1; torch's ZB-V
# pattern needs m >= 2p - 1.
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "1F1B": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_order(p, m, k), segmented=False,
        analytic=lambda p, v, m, k: analytic_bubble(p, m),
    ),
    "GPipe": ScheduleSpec(
        lambda p, v, m, k: gpipe_order(p, m, k), segmented=False,
        analytic=lambda p, v, m, k: analytic_bubble(p, m),
    ),
    "Seq1F1B": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_order(p, m, k), segmented=True,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k),
    ),
    "Interleaved1F1B": ScheduleSpec(
        interleaved_seq1f1b_order, segmented=False, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m * k >= p else None,
    ),
    "InterleavedSeq1F1B": ScheduleSpec(
        interleaved_seq1f1b_order, segmented=True, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m * k >= p else None,
    ),
    "Seq1F1BZeroBubble": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_zero_bubble_order(p, m, k), segmented=True,
        analytic=lambda p, v, m, k: (
            _zero_bubble_analytic(p, v, m, k) if m * k >= p + k - 1 else None
        ),
    ),
    "Seq1F1BZBV": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_zbv_order(p, m, k), segmented=True,
        min_chunks=2, max_chunks=2, analytic=lambda p, v, m, k: None,
    ),
    "LoopedBFS": ScheduleSpec(
        _torch_order("LoopedBFS"), segmented=False, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m >= p else None,
    ),
    "ZBVZeroBubble": ScheduleSpec(
        _torch_order("ZBVZeroBubble"), segmented=False, min_chunks=2, max_chunks=2,
        analytic=lambda p, v, m, k: _zero_bubble_analytic(p, v, m, k) if m >= 2 * p - 1 else None,
    ),
}
SCHEDULES = tuple(SCHEDULE_SPECS)

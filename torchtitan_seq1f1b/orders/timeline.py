# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Replaying an order in time: when each action runs, and the bubble it leaves.

The simulator replays orders with modelled action times; training metrics
replay the schedule's own order with equal-cost units for its bubble.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_seq1f1b.actions import Order, SegmentAction

__all__ = ["Timeline", "equal_cost_bubble", "replay"]


@dataclass(frozen=True)
class Timeline:
    """Start/end time of every action, and each rank's busy time."""

    makespan: float
    busy: dict[int, float]
    spans: dict[SegmentAction, tuple[float, float]]

    @property
    def bubble_fraction(self) -> float:
        ranks = len(self.busy)
        if self.makespan == 0:
            return 0.0
        return 1 - sum(self.busy.values()) / (ranks * self.makespan)


def replay(
    order: Order,
    duration: Callable[[SegmentAction], float],
    p2p_latency: float = 0.0,
) -> Timeline:
    """Replay ``order`` with its data dependencies across stages.

    The rank of every stage is read from ``order`` (any placement works);
    ``p2p_latency`` is added to dependencies between different ranks. An
    action's start time depends only on its rank's previous action and on its
    dependency, so filling the ranks in any order that respects those
    dependencies gives the same timeline.
    """
    rank_of = {a.stage: rank for rank, actions in order.items() for a in actions}
    scheduled = {a for actions in order.values() for a in actions}
    last_stage = max(rank_of, default=0)

    def dependency(action: SegmentAction) -> SegmentAction | None:
        stage, unit = action.stage, action.unit
        if action.kind == "F":
            return SegmentAction(stage - 1, "F", *unit) if stage > 0 else None
        if action.kind == "W":
            return SegmentAction(stage, "I", *unit)
        if stage == last_stage:
            return SegmentAction(stage, "F", *unit)
        upstream = [SegmentAction(stage + 1, kind, *unit) for kind in "BI"]
        found = [a for a in upstream if a in scheduled]
        if not found:
            raise ValueError(f"{action}: stage {stage + 1} never runs this unit's backward")
        return found[0]

    position = {rank: 0 for rank in order}
    free_at = {rank: 0.0 for rank in order}
    busy = {rank: 0.0 for rank in order}
    spans: dict[SegmentAction, tuple[float, float]] = {}
    remaining = len(scheduled)
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                dep = dependency(action)
                if dep is not None and dep not in spans:
                    break
                ready = 0.0
                if dep is not None:
                    ready = spans[dep][1] + (p2p_latency if rank_of[dep.stage] != rank else 0.0)
                start = max(free_at[rank], ready)
                end = start + duration(action)
                spans[action] = (start, end)
                free_at[rank] = end
                busy[rank] += end - start
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [str(order[r][position[r]]) for r in order if position[r] < len(order[r])]
            raise ValueError(f"order deadlocks; next actions {waiting}")
    return Timeline(max(free_at.values(), default=0.0), busy, spans)


def _equal_cost_duration(num_segments: int, chunks: int) -> Callable[[SegmentAction], float]:
    """F = I = W = 1/(k v), B = 2/(k v): one microbatch over a rank's blocks costs 1 + 2."""
    return lambda action: (2 if action.kind == "B" else 1) / (num_segments * chunks)


def equal_cost_bubble(order: Order, num_segments: int, chunks: int) -> float:
    """Idle fraction of ``order`` when all units cost the same (F = I = W, B = 2F)."""
    return replay(order, _equal_cost_duration(num_segments, chunks)).bubble_fraction

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Predicted step time, bubble and per-rank memory of one segment plan under one schedule.

The schedule's real per-rank order is replayed with the calibrated unit times
plus the runtime's own cost per action
(:func:`~torchtitan_seq1f1b.orders.replay`), plus the runtime's cost once per
step, and walked for the bytes each
rank holds: every unit's saved activations until its backward (B, or W after
I), and every microbatch's K/V store from its first forward to its last
backward, with the fp32 gradient bank from its first backward on. Under
context parallelism a rank computes and keeps its ``1/c`` share of every unit
and runs the K/V collectives (:class:`ContextParallelCost`); its K/V store
holds the gathered K/V, the whole sequence's as without CP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_seq1f1b.actions import Order, SegmentAction
from torchtitan_seq1f1b.orders import replay
from torchtitan_seq1f1b.planner.time_model import ContextParallelCost, TimeModel
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["PipelineShape", "PlanEstimate", "estimate", "even_stage_blocks"]


def even_stage_blocks(n_layers: int, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage, split as evenly as they go, a remainder on the earliest stages."""
    base, extra = divmod(n_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


@dataclass(frozen=True)
class PipelineShape:
    """What runs where.

    Args:
        stage_blocks: transformer blocks on each stage, by stage index; the
            last stage also holds the head.
        order: the schedule's per-rank order for ``k`` segments per microbatch.
        linear_share: the share of every stage's blocks that are GatedDeltaNet
            (the model's share, spread evenly); they keep no K/V store.
        carry_bytes: what one GatedDeltaNet block carries across one cut for a
            microbatch (fp32 state and conv tail); ``carry_grad_bytes`` its
            banked fp32 gradient.
    """

    stage_blocks: tuple[int, ...]
    order: Callable[[int], Order]
    linear_share: float = 0.0
    carry_bytes: float = 0.0
    carry_grad_bytes: float = 0.0

    @property
    def last_stage(self) -> int:
        return len(self.stage_blocks) - 1

    @classmethod
    def even(
        cls, n_layers: int, num_stages: int, order: Callable[[int], Order], **linear
    ) -> PipelineShape:
        """Blocks split by :func:`even_stage_blocks`; ``linear``: the GatedDeltaNet fields."""
        if num_stages > n_layers:
            raise ValueError(
                f"{num_stages} pipeline stages need at least as many blocks, the model has "
                f"{n_layers}; use fewer pipeline ranks or stages per rank"
            )
        return cls(even_stage_blocks(n_layers, num_stages), order, **linear)


@dataclass(frozen=True)
class PlanEstimate:
    """What one plan is predicted to cost; bytes are activations plus K/V store, per rank.

    ``bubble_fraction`` is the idle share of the replayed actions; the runtime's
    once-per-step cost, in ``step_seconds``, is not in it.
    """

    plan: SegmentPlan
    partition: str
    step_seconds: float
    bubble_fraction: float
    peak_bytes: tuple[int, ...]

    @property
    def num_segments(self) -> int:
        return self.plan.num_segments


def _peak_bytes(
    actions: list[SegmentAction],
    plan: SegmentPlan,
    shape: PipelineShape,
    model: TimeModel,
    context_parallel: int,
) -> int:
    """Largest activation + K/V (and GatedDeltaNet carry) footprint of one rank of
    ``context_parallel`` over its order."""
    live: dict[tuple[int, int, int], float] = {}  # (stage, microbatch, segment)
    stores: dict[tuple[int, int], float] = {}  # (stage, microbatch)
    peak = 0.0
    k = plan.num_segments
    for action in actions:
        stage, (microbatch, segment) = action.stage, action.unit
        blocks = shape.stage_blocks[stage]
        linear = blocks * shape.linear_share
        if action.kind == "F":
            has_head = stage == shape.last_stage
            live[(stage, microbatch, segment)] = model.unit_activation_bytes(
                plan.lengths[segment] // context_parallel, blocks, has_head
            )
            stores.setdefault((stage, microbatch), (blocks - linear) * model.kv_bytes * plan.seq_len)
            if segment < k - 1:  # what the next segment starts from
                stores[(stage, microbatch)] += linear * shape.carry_bytes
        elif segment == k - 1 and action.kind in "BI" and k > 1:
            # The first backward banks fp32 gradients of every key a later segment read,
            # and of the state and tail its segment started from.
            stores[(stage, microbatch)] += (
                (blocks - linear) * model.kv_grad_bytes * plan.offsets[-1]
                + linear * shape.carry_grad_bytes
            )
        peak = max(peak, sum(live.values()) + sum(stores.values()))
        if action.kind in "BW":
            del live[(stage, microbatch, segment)]
            if segment == 0:
                del stores[(stage, microbatch)]
    return int(peak)


def estimate(
    plan: SegmentPlan,
    partition: str,
    shape: PipelineShape,
    model: TimeModel,
    context_parallel: ContextParallelCost = ContextParallelCost(),
) -> PlanEstimate:
    """Replay ``shape``'s order for ``plan`` with ``model``'s unit times and walk its memory,
    on one rank of ``context_parallel``'s group per stage (``plan``'s lengths multiples of 2c)."""
    order = shape.order(plan.num_segments)
    cp = context_parallel.degree

    def seconds(action: SegmentAction) -> float:
        length = plan.lengths[action.segment]
        unit = model.unit_seconds(
            action.kind,
            length,
            plan.ends[action.segment],
            shape.stage_blocks[action.stage],
            action.stage == shape.last_stage,
            action.stage == 0,
            context_parallel,
        )
        return unit + model.runtime.action_seconds(length // cp)  # hand-offs carry L / c

    timeline = replay(order, seconds)
    return PlanEstimate(
        plan=plan,
        partition=partition,
        step_seconds=timeline.makespan + model.runtime.per_step,
        bubble_fraction=timeline.bubble_fraction,
        peak_bytes=tuple(_peak_bytes(order[r], plan, shape, model, cp) for r in sorted(order)),
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B orders with split backwards: input gradient (I) and weight gradient (W).

- :func:`seq1f1b_zero_bubble_order` (v = 1): Seq1F1B's F and I order, W
  deferred so that it fills bubbles, ZB-H1 style, within 1F1B's memory.
- :func:`seq1f1b_zbv_order` (v = 2, stages r and 2p-1-r on rank r): split
  backwards on a V, ZB-V style, by list scheduling.
"""

from collections.abc import Callable

from torchtitan_seq1f1b.actions import Order, SegmentAction
from torchtitan_seq1f1b.orders.one_f_one_b import seq1f1b_warmup
from torchtitan_seq1f1b.orders.units import backward_units, check_positive, forward_units

__all__ = ["seq1f1b_zbv_order", "seq1f1b_zero_bubble_order", "v_stage_to_rank"]


def seq1f1b_zero_bubble_order(
    num_stages: int, n_microbatches: int, num_segments: int
) -> Order:
    """Seq1F1B with split backwards, ZB-H1 style; one stage per rank.

    Forwards and input gradients (I) follow :func:`seq1f1b_order`. Rank r
    defers its weight gradients (W, in I order) by ``warmup_0 - warmup_r``
    actions (r when nothing is capped): every rank then holds at most rank
    0's ``p + k - 1`` units whose W is outstanding, 1F1B's peak, and the
    deferred W actions fill the cooldown, where later ranks would idle.
    """
    check_positive(
        num_stages=num_stages, n_microbatches=n_microbatches, num_segments=num_segments
    )
    units = forward_units(n_microbatches, num_segments)
    backwards = backward_units(n_microbatches, num_segments)
    first_warmup = seq1f1b_warmup(num_stages, 0, len(units), num_segments)
    order: Order = {}
    for rank in range(num_stages):
        warmup = seq1f1b_warmup(num_stages, rank, len(units), num_segments)
        deferred = first_warmup - warmup
        forwards = iter(units)
        actions = [SegmentAction(rank, "F", *next(forwards)) for _ in range(warmup)]
        weights = iter(backwards)
        for index, unit in enumerate(backwards):
            forward = next(forwards, None)
            if forward is not None:
                actions.append(SegmentAction(rank, "F", *forward))
            actions.append(SegmentAction(rank, "I", *unit))
            if index >= deferred:
                actions.append(SegmentAction(rank, "W", *next(weights)))
        actions.extend(SegmentAction(rank, "W", *unit) for unit in weights)
        order[rank] = actions
    return order


def v_stage_to_rank(num_ranks: int) -> Callable[[int], int]:
    """V placement: stage s on rank s for s < p, else on rank 2p-1-s."""
    return lambda stage: stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def seq1f1b_zbv_order(num_ranks: int, n_microbatches: int, num_segments: int) -> Order:
    """Seq1F1B with split backwards on a V: rank r holds stages r and 2p-1-r.

    A unit goes down the ranks on the first chunk and back up on the second,
    so the first and the last stage (the loss) share rank 0. The order comes
    from list scheduling with equal-cost actions (F = I = W): at every step a
    free rank runs the first of these that is ready, each on the later stage
    first so units drain towards the loss:

    1. an input gradient (the ranks before it wait for it);
    2. a forward, while fewer than ``2 * (p + k - 1)`` units (of half a
       stage each) await their W: Seq1F1B's rank-0 activation memory;
    3. a weight gradient, filling what would be a bubble.

    Per stage, forwards run in unit order and I and W in backward unit order,
    so stage 0's W steps (which hold its whole backward) go last segment first.
    """
    check_positive(
        num_ranks=num_ranks, n_microbatches=n_microbatches, num_segments=num_segments
    )
    num_stages = 2 * num_ranks
    sequences = {
        "F": forward_units(n_microbatches, num_segments),
        "I": backward_units(n_microbatches, num_segments),
        "W": backward_units(n_microbatches, num_segments),
    }
    n_units = len(sequences["F"])
    in_flight_limit = 2 * (num_ranks + num_segments - 1)
    next_index = {(stage, kind): 0 for stage in range(num_stages) for kind in "FIW"}
    finished_at: dict[SegmentAction, int] = {}

    def next_ready(stage: int, kind: str, now: int) -> SegmentAction | None:
        index = next_index[(stage, kind)]
        if index == n_units:
            return None
        action = SegmentAction(stage, kind, *sequences[kind][index])
        needs = {
            "F": [SegmentAction(stage - 1, "F", *action.unit)] if stage > 0 else [],
            "I": [SegmentAction(stage, "F", *action.unit)]
            + ([SegmentAction(stage + 1, "I", *action.unit)] if stage < num_stages - 1 else []),
            "W": [SegmentAction(stage, "I", *action.unit)],
        }[kind]
        done = all(finished_at.get(need, now + 1) <= now for need in needs)
        return action if done else None

    order: Order = {rank: [] for rank in range(num_ranks)}
    awaiting_w = dict.fromkeys(range(num_ranks), 0)
    now = 0
    while len(finished_at) < 3 * n_units * num_stages:
        for rank in range(num_ranks):
            later_first = (num_stages - 1 - rank, rank)
            kinds = "IFW" if awaiting_w[rank] < in_flight_limit else "IW"
            action = next(
                (
                    ready
                    for kind in kinds
                    for stage in later_first
                    if (ready := next_ready(stage, kind, now)) is not None
                ),
                None,
            )
            if action is None:
                continue
            next_index[(action.stage, action.kind)] += 1
            finished_at[action] = now + 1
            awaiting_w[rank] += {"F": 1, "I": 0, "W": -1}[action.kind]
            order[rank].append(action)
        now += 1
    return order

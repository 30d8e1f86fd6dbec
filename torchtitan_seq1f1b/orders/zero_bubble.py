# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B orders with split backwards: input gradient (I) and weight gradient (W).

- :func:`seq1f1b_zero_bubble_order` (v = 1): Seq1F1B's F and I order, W
  deferred so that it fills bubbles, ZB-H1 style, within 1F1B's memory.
- :func:`seq1f1b_zbv_order` (v = 2, stages r and 2p-1-r on rank r): split
  backwards on a V, ZB-V's warmup/steady/cooldown pattern over units; with
  k = 1 it is torch's ZBVZeroBubble order.
"""

from collections import Counter
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


# (chunk, kind) slots of the V pattern: chunk 0 is stage r, chunk 1 is stage 2p-1-r.
_F0, _I0, _W0 = (0, "F"), (0, "I"), (0, "W")
_F1, _I1, _W1 = (1, "F"), (1, "I"), (1, "W")


def _zbv_pattern(
    num_ranks: int, rank: int, num_segments: int, n_units: int
) -> list[tuple[int, str]]:
    """Rank r's (chunk, kind) slots for ``n_units >= 2p + k - 2`` units, 6 * n_units long.

    ``lead = r + k - 1`` is how far chunk 1's forwards run ahead of its input
    gradients: r units are still on their way back up the V, and the first
    backward unit (0, k-1) is the k-th forward.
    """
    p, r = num_ranks, rank
    lead = r + num_segments - 1
    # Chunk 0 forwards until unit 0 comes back up the V, 2(p-r)-1 slots later;
    # then one chunk-0 forward between chunk-1 forwards, which now arrive
    # every other slot; then each chunk-1 forward's I and W, freeing it at once.
    warmup = [_F0] * (2 * (p - r) - 1) + [_F1, _F0] * lead + [_F1, _I1, _W1] * (p - r)
    rounds = n_units - lead - (p - r)  # the chunk-1 forwards left
    with_forward = n_units - lead - 2 * (p - r) + 1  # the chunk-0 forwards left
    steady = [_F0, _I0, _W0, _F1, _I1, _W1] * with_forward
    steady += [_I0, _W0, _F1, _I1, _W1] * (rounds - with_forward)
    # Input gradients first, since the ranks beyond wait for them; the W
    # deferred meanwhile fill the end.
    cooldown = [_I0, _I1] * lead + [_I0, _W0] * (p - r) + [_W1] * lead + [_W0] * lead
    return warmup + steady + cooldown


def seq1f1b_zbv_order(num_ranks: int, n_microbatches: int, num_segments: int) -> Order:
    """Seq1F1B with split backwards on a V: rank r holds stages r and 2p-1-r.

    A unit goes down the ranks on the first chunk (stage r) and back up on
    the second (stage 2p-1-r), so the first and the last stage (the loss)
    share rank 0. Every rank runs ZB-V's fixed pattern over the m*k units,
    with lead ``r + k - 1`` (chunk-1 forwards run before its first I):

    1. warmup: ``2(p-r) - 1`` chunk-0 forwards, ``lead`` pairs (F1, F0), then
       ``p - r`` triples (F1, I1, W1);
    2. steady: (F0, I0, W0, F1, I1, W1) until chunk 1's forwards are done,
       F0 left out once chunk 0's are;
    3. cooldown: ``lead`` pairs (I0, I1), ``p - r`` pairs (I0, W0), then the
       remaining W on chunk 1, then on chunk 0.

    A slot names a chunk and a kind; its unit is that chunk's next in unit
    order for F and in backward unit order (FIFO by microbatch, LIFO by
    segment) for I and W. Fewer than ``2p + k - 2`` units fill the pattern
    for that many and skip the slots of missing units. With k = 1 this is
    torch's ZBVZeroBubble order. Every rank holds at most ``2(p + k - 1)``
    half-stage units awaiting W, Seq1F1B's rank-0 activation memory, and with
    equal-cost actions the bubble is ZB-V's ``(p-1) / (6mk + p-1)`` once
    ``m*k >= 2p + k - 2``.
    """
    check_positive(
        num_ranks=num_ranks, n_microbatches=n_microbatches, num_segments=num_segments
    )
    units = {
        "F": forward_units(n_microbatches, num_segments),
        "I": backward_units(n_microbatches, num_segments),
        "W": backward_units(n_microbatches, num_segments),
    }
    n_units = len(units["F"])
    n_pattern = max(n_units, 2 * num_ranks + num_segments - 2)
    order: Order = {}
    for rank in range(num_ranks):
        stages = (rank, 2 * num_ranks - 1 - rank)
        taken: Counter[tuple[int, str]] = Counter()
        order[rank] = []
        for chunk, kind in _zbv_pattern(num_ranks, rank, num_segments, n_pattern):
            index = taken[chunk, kind]
            taken[chunk, kind] += 1
            if index < n_units:
                order[rank].append(SegmentAction(stages[chunk], kind, *units[kind][index]))
    return order

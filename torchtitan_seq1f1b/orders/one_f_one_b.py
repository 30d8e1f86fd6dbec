# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B orders with whole backwards: one stage per rank, interleaved, and GPipe.

Notation: p ranks, v stages (model chunks) per rank, m microbatches, k
segments, rank r.

- :func:`seq1f1b_order` (v = 1): rank r runs ``min(m*k, (p-r-1) + (k-1))``
  warmup forwards, then one-forward-one-backward pairs, then the remaining
  backwards. With k = 1 this is exactly torch's 1F1B order.
- :func:`interleaved_seq1f1b_order` (v >= 2, stage ``c*p + r`` on rank r):
  torch's interleaved 1F1B over the m*k units, whose warmup grows by the
  forwards a rank must run before its first backward is possible (k - 1
  more when rounds hold whole microbatches). With k = 1 it is exactly
  torch's Interleaved1F1B order.
- :func:`gpipe_order`: every forward, then every backward (for comparison).
"""

from torchtitan_seq1f1b.actions import Order, SegmentAction, Unit
from torchtitan_seq1f1b.orders.units import backward_units, check_positive, forward_units

__all__ = [
    "gpipe_order",
    "interleaved_seq1f1b_order",
    "seq1f1b_order",
    "seq1f1b_warmup",
]


def _one_forward_one_backward(
    forwards: list[SegmentAction], backwards: list[SegmentAction], warmup: int
) -> list[SegmentAction]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    actions = forwards[:warmup]
    pending = iter(backwards)
    for forward in forwards[warmup:]:
        actions += [forward, next(pending)]
    actions.extend(pending)
    return actions


def seq1f1b_warmup(num_stages: int, rank: int, n_units: int, num_segments: int) -> int:
    return min(n_units, (num_stages - rank - 1) + (num_segments - 1))


def seq1f1b_order(num_stages: int, n_microbatches: int, num_segments: int) -> Order:
    """The Seq1F1B order of every rank, one stage per rank."""
    check_positive(
        num_stages=num_stages, n_microbatches=n_microbatches, num_segments=num_segments
    )
    units = forward_units(n_microbatches, num_segments)
    backwards = backward_units(n_microbatches, num_segments)
    return {
        rank: _one_forward_one_backward(
            [SegmentAction(rank, "F", *u) for u in units],
            [SegmentAction(rank, "B", *u) for u in backwards],
            seq1f1b_warmup(num_stages, rank, len(units), num_segments),
        )
        for rank in range(num_stages)
    }


def gpipe_order(num_stages: int, n_microbatches: int, num_segments: int = 1) -> Order:
    """GPipe: every forward in unit order, then every backward.

    Backwards are FIFO over microbatches and LIFO over segments, the order the
    segment checker requires (torch's ScheduleGPipe for ``num_segments = 1``).
    """
    units = forward_units(n_microbatches, num_segments)
    backward = backward_units(n_microbatches, num_segments)
    return {
        rank: [SegmentAction(rank, "F", *u) for u in units]
        + [SegmentAction(rank, "B", *u) for u in backward]
        for rank in range(num_stages)
    }


def _round_sizes(n_units: int, num_ranks: int) -> list[int]:
    """Torch's interleaved rounds, ``max(1, n // p)`` of them, spread evenly.

    torch requires the units to divide into its rounds; rounds that differ by
    one unit give a valid order as well, so no unit count is refused.
    """
    rounds = max(1, n_units // num_ranks)
    size, larger = divmod(n_units, rounds)
    return [size + 1] * larger + [size] * (rounds - larger)


def _by_rounds(
    units: list[Unit], round_sizes: list[int], chunks: list[int]
) -> list[tuple[int, Unit]]:
    """(chunk, unit) in round-robin order: every chunk runs a round's units in turn."""
    order, start = [], 0
    for size in round_sizes:
        order += [(chunk, unit) for chunk in chunks for unit in units[start : start + size]]
        start += size
    return order


def interleaved_seq1f1b_order(
    num_ranks: int, num_chunks: int, n_microbatches: int, num_segments: int
) -> Order:
    """Interleaved Seq1F1B: ``num_chunks`` stages per rank, stage ``c*p + r`` on rank r.

    Every rank runs the same chunk/unit sequences (torch's interleaved rounds
    over units). Forwards take the chunks in turn; backwards take them last to
    first, over units FIFO by microbatch and LIFO by segment. A rank's first
    backward needs its forward done first; torch's warmup
    ``(v-1)*round + 2*(p-1-r)`` is generalised to that need plus ``2*(p-1-r)``,
    which is ``(v-1)*round + (k-1) + 2*(p-1-r)`` when rounds hold whole
    microbatches.
    """
    check_positive(
        num_ranks=num_ranks,
        num_chunks=num_chunks,
        n_microbatches=n_microbatches,
        num_segments=num_segments,
    )
    units = forward_units(n_microbatches, num_segments)
    sizes = _round_sizes(len(units), num_ranks)
    forwards = _by_rounds(units, sizes, list(range(num_chunks)))
    backwards = _by_rounds(
        backward_units(n_microbatches, num_segments), sizes, list(reversed(range(num_chunks)))
    )
    position = {chunk_unit: index for index, chunk_unit in enumerate(forwards)}
    # The b-th backward runs right after forward number warmup + b.
    first_backward_need = max(position[cu] - b for b, cu in enumerate(backwards))
    order: Order = {}
    for rank in range(num_ranks):
        warmup = min(len(forwards), first_backward_need + 2 * (num_ranks - 1 - rank))
        order[rank] = _one_forward_one_backward(
            [SegmentAction(c * num_ranks + rank, "F", *u) for c, u in forwards],
            [SegmentAction(c * num_ranks + rank, "B", *u) for c, u in backwards],
            warmup,
        )
    return order

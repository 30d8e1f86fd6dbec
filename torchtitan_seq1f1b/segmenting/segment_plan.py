# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How a sequence is cut into Seq1F1B segments.

Seq1F1B (arXiv 2406.03488) pipelines each micro-batch as ``k`` consecutive
segments along the sequence. Under causal attention a segment attends to all
tokens before it, so equal-length segments cost more the later they sit (7B at
32k tokens, ``k=4``: the last does ~1.3x the mean work and paces the pipeline).
:meth:`SegmentPlan.balanced` picks lengths that equalise forward FLOPs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from torchtitan_seq1f1b.segmenting.cost import is_int, SegmentCost

__all__ = ["nearest_aligned", "SegmentPlan", "scaled_seq_len"]


def _check_split(seq_len: int, num_segments: int, align: int) -> None:
    for name, value in (("num_segments", num_segments), ("seq_len", seq_len), ("align", align)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if seq_len % align:
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of align={align}; "
            f"pick a seq_len divisible by {align}"
        )
    if num_segments > seq_len // align:
        raise ValueError(
            f"num_segments={num_segments} is too large: seq_len={seq_len} holds at most "
            f"{seq_len // align} segments of at least align={align} tokens; "
            f"use num_segments <= {seq_len // align}"
        )


def _check_lengths(lengths: tuple[int, ...]) -> None:
    if not lengths or not all(is_int(n) and n > 0 for n in lengths):
        raise ValueError(f"lengths={list(lengths)} must be a non-empty list of positive ints")


def nearest_aligned(lengths: tuple[int, ...] | list[int], align: int) -> list[int]:
    """Lengths near ``lengths`` that are multiples of ``align``, for an error to suggest.

    Each border between segments moves to its nearest multiple of ``align`` that leaves
    every segment at least ``align`` tokens; the total keeps its value when it is a
    multiple of ``align`` and there is room, else it rounds up.
    """
    count, total = len(lengths), -(-sum(lengths) // align) * align
    borders, previous = [], 0
    for i, end in enumerate(accumulate(lengths[:-1])):
        latest = max(total - align * (count - 1 - i), previous + align)
        previous = min(max(previous + align, round(end / align) * align), latest)
        borders.append(previous)
    borders.append(max(total, previous + align))
    return [end - start for start, end in zip([0, *borders], borders)]


def _fit_from_end(
    seq_len: int, num_segments: int, cost: SegmentCost, align: int, budget: int
) -> tuple[int, ...]:
    """Lengths with each segment, from the last back, as long as ``budget`` FLOPs allow.

    Every segment keeps at least ``align`` tokens; only the first may exceed ``budget``.
    Taking the longest segment each time is optimal: it leaves the shortest prefix, and
    a shorter prefix is never harder to split (a segment's cost is a sum of positive
    per-position costs, so a sub-span costs no more than its span).
    """
    end, lengths = seq_len, []
    for segments_before in range(num_segments - 1, 0, -1):
        # Bisection over align units: the cost of a segment ending at `end` grows with its
        # length whatever the attention mask, so no closed form is needed.
        fits, too_long = 1, end // align - segments_before + 1
        while too_long - fits > 1:
            units = (fits + too_long) // 2
            if cost.forward_flops(units * align, end) <= budget:
                fits = units
            else:
                too_long = units
        lengths.append(fits * align)
        end -= fits * align
    lengths.append(end)
    return tuple(reversed(lengths))


@dataclass(frozen=True)
class SegmentPlan:
    """Lengths of the ``num_segments`` consecutive segments covering ``[0, seq_len)``.

    Args:
        seq_len: tokens per sample.
        lengths: tokens per segment, in sequence order; must sum to ``seq_len``.
    """

    seq_len: int
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if not is_int(self.seq_len) or self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len!r} must be a positive int")
        _check_lengths(self.lengths)
        if sum(self.lengths) != self.seq_len:
            raise ValueError(
                f"lengths={list(self.lengths)} sum to {sum(self.lengths)}, "
                f"not seq_len={self.seq_len}"
            )

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start position of each segment; ``offsets[0] == 0``."""
        return (0, *accumulate(self.lengths[:-1]))

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end position of each segment; ``ends[-1] == seq_len``."""
        return tuple(accumulate(self.lengths))

    def slices(self) -> tuple[slice, ...]:
        """One ``slice`` per segment, for indexing the sequence dimension."""
        return tuple(slice(start, end) for start, end in zip(self.offsets, self.ends))

    def segment_flops(self, cost: SegmentCost) -> tuple[int, ...]:
        """Forward FLOPs of each segment under ``cost``."""
        return tuple(cost.forward_flops(n, end) for n, end in zip(self.lengths, self.ends))

    def __str__(self) -> str:
        return f"SegmentPlan(seq_len={self.seq_len}, lengths={list(self.lengths)})"

    @classmethod
    def uniform(cls, seq_len: int, num_segments: int, align: int = 1) -> SegmentPlan:
        """Lengths as equal as possible, each a multiple of ``align``.

        Leftover ``align``-sized units go to the earliest segments, which are
        the cheapest per token under causal attention.
        """
        _check_split(seq_len, num_segments, align)
        base, extra = divmod(seq_len // align, num_segments)
        units = [base + 1] * extra + [base] * (num_segments - extra)
        return cls(seq_len, tuple(u * align for u in units))

    @classmethod
    def balanced(
        cls, seq_len: int, num_segments: int, cost: SegmentCost, align: int = 1
    ) -> SegmentPlan:
        """Lengths (multiples of ``align``) that equalise forward FLOPs across segments.

        The costliest segment paces the pipeline, so this returns a plan whose
        largest ``cost.forward_flops`` is the smallest any ``align``-multiple plan
        can reach (hence never above :meth:`uniform`'s). The cost is additive,
        so that largest cost is at least ``T = forward_flops(seq_len, seq_len) /
        num_segments``. For a FLOP budget ``B``, segments are fitted from the last
        back, each the longest (bisection) that costs at most ``B``; bisection
        over integer ``B`` in ``[T, uniform's max]`` finds the least ``B`` that
        the first segment fits too. With ``align=1`` that ``B`` is ``T`` to within
        a few tokens' FLOPs.
        """
        _check_split(seq_len, num_segments, align)
        if not callable(getattr(cost, "forward_flops", None)):
            raise ValueError(
                f"cost={cost!r} must provide forward_flops(length, end); use a "
                "TransformerCost, or a PackedDocumentsCost under packed documents"
            )
        built_for = getattr(cost, "seq_len", seq_len)
        if built_for != seq_len:
            raise ValueError(
                f"cost was built for seq_len={built_for}, not {seq_len}; build it for "
                f"windows of {seq_len} tokens"
            )
        # Invariant: no plan fits within `infeasible`; `best` fits within `budget`.
        infeasible = -(-cost.forward_flops(seq_len, seq_len) // num_segments) - 1
        best = cls.uniform(seq_len, num_segments, align)
        budget = max(best.segment_flops(cost))
        while budget - infeasible > 1:
            trial = (budget + infeasible) // 2
            plan = cls(seq_len, _fit_from_end(seq_len, num_segments, cost, align, trial))
            if max(plan.segment_flops(cost)) <= trial:
                best, budget = plan, trial
            else:
                infeasible = trial
        return best

    @classmethod
    def from_lengths(cls, lengths: tuple[int, ...] | list[int], align: int = 1) -> SegmentPlan:
        """Plan from user-given lengths, each positive and a multiple of ``align``."""
        if not is_int(align) or align < 1:
            raise ValueError(f"align={align!r} must be a positive int")
        lengths = tuple(lengths)
        _check_lengths(lengths)
        misaligned = [n for n in lengths if n % align]
        if misaligned:
            raise ValueError(
                f"lengths={list(lengths)} has {misaligned} not a multiple of align={align}; "
                f"use multiples of {align}, e.g. {nearest_aligned(lengths, align)}"
            )
        return cls(sum(lengths), lengths)


def scaled_seq_len(reference_len: int, reference_tokens: int, seq_len: int) -> int:
    """Local length of a ``seq_len``-token segment on a dim that held ``reference_len``
    entries for a ``reference_tokens``-token segment.

    Under sequence parallel a stage's activations carry ``tokens / tp`` entries
    on the sequence dim, as plain local tensors or as DTensor shards.
    """
    local, remainder = divmod(seq_len * reference_len, reference_tokens)
    if remainder:
        raise ValueError(
            f"a {seq_len}-token segment cannot be laid out like the first one "
            f"({reference_tokens} tokens held as {reference_len} entries, e.g. sharded "
            "by sequence parallel); make every segment length a multiple of the "
            "sequence-parallel degree (SegmentPlan align, [seq1f1b] align)"
        )
    return local

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Where context parallelism puts each segment's tokens: head-tail pieces per segment.

A segment of ``L`` tokens (a multiple of ``2c``) is cut into ``2c`` pieces of
``L / 2c``; CP rank ``r`` holds pieces ``r`` and ``2c - 1 - r``, back to back.
Under causal attention piece ``i`` of a segment starting at ``s`` attends
``s + (i + 1) L / 2c`` keys, so every rank's two pieces attend the same number
of keys, ``2s + (2c + 1) L / 2c``: each rank does an equal share of every
segment. Head-tail over the whole sequence would leave some segments on some
ranks only.

Layouts along the sequence dim: a rank's share of a segment is ``(..., L / c, ...)``;
an all-gather stacks the ranks' shares in rank order, ``(c, ..., L / c, ...)``,
which :meth:`HeadTail.sequence_order` turns back into ``(..., L, ...)``.
"""

import math
from dataclasses import dataclass

import torch

__all__ = ["HeadTail", "check_context_parallel", "context_parallel_align"]


def context_parallel_align(align: int, degree: int) -> int:
    """What segment lengths must be multiples of: ``align``, and under context parallelism
    of ``degree`` > 1 also ``2 * degree`` (every segment is cut into that many pieces)."""
    return align if degree == 1 else math.lcm(align, 2 * degree)


def check_context_parallel(seq_len: int, align: int, degree: int) -> int:
    """:func:`context_parallel_align`; raises ValueError, saying what fits, unless
    ``seq_len`` is a multiple of it."""
    aligned = context_parallel_align(align, degree)
    if seq_len % aligned:
        below = seq_len // aligned * aligned
        nearest = " or ".join(str(n) for n in (below, below + aligned) if n)
        raise ValueError(
            f"context parallelism of degree {degree} cuts every segment into {2 * degree} "
            f"pieces, so segment lengths are multiples of {aligned}"
            + (f" (lcm with align {align})" if aligned != 2 * degree else "")
            + f" and seq_len {seq_len} is not one; pick a seq_len divisible by {aligned} "
            f"(e.g. {nearest}) or a degree c with {seq_len} divisible by 2c"
        )
    return aligned


@dataclass(frozen=True)
class HeadTail:
    """Head-tail pieces of segments for CP rank ``rank`` of ``degree`` ranks."""

    degree: int
    rank: int

    def __post_init__(self):
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"CP rank {self.rank} is outside degree {self.degree}")

    @property
    def pieces(self) -> int:
        return 2 * self.degree

    def spans(self, start: int, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's two pieces of the segment ``[start, start + length)``, as
        ``(begin, end)`` positions of the sequence."""
        size = self._piece_size(length)
        head, tail = self.rank, self.pieces - 1 - self.rank
        return (
            (start + head * size, start + (head + 1) * size),
            (start + tail * size, start + (tail + 1) * size),
        )

    def positions(self, start: int, length: int, device=None) -> torch.Tensor:
        """(length / degree,) int64: the sequence positions of this rank's share."""
        return torch.cat([torch.arange(b, e, device=device) for b, e in self.spans(start, length)])

    def share(self, segment: torch.Tensor, dim: int) -> torch.Tensor:
        """(..., L, ...) -> (..., L / degree, ...): this rank's two pieces of a segment."""
        size = self._piece_size(segment.shape[dim])
        pieces = segment.split(size, dim)
        return torch.cat((pieces[self.rank], pieces[self.pieces - 1 - self.rank]), dim)

    def sequence_order(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """(degree, ..., L / degree, ...) shares in rank order -> (..., L, ...) in sequence
        order; ``dim`` indexes a share's dims."""
        heads, tails = gathered.chunk(2, dim + 1)
        return torch.cat((*heads.unbind(0), *reversed(tails.unbind(0))), dim)

    def rank_order(self, segment: torch.Tensor, dim: int) -> torch.Tensor:
        """(..., L, ...) -> (degree, ..., L / degree, ...): every rank's share, in rank order
        (what a reduce-scatter over the CP group splits along its first dim)."""
        size = self._piece_size(segment.shape[dim])
        pieces = segment.split(size, dim)
        return torch.stack(
            [torch.cat((pieces[r], pieces[self.pieces - 1 - r]), dim) for r in range(self.degree)]
        )

    def _piece_size(self, length: int) -> int:
        if length % self.pieces:
            raise ValueError(
                f"a segment of {length} tokens cannot be cut into {self.pieces} head-tail "
                f"pieces for context parallelism of degree {self.degree}; segment lengths "
                f"must be multiples of 2 * degree = {self.pieces}"
            )
        return length // self.pieces

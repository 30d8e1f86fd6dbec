# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The segment plan a job's ``seq1f1b`` options ask for, whichever torchtitan runs it.

Each adapter reads the options, ``training.seq_len``, the tensor-parallel
degree and the model's dims out of its release's config and model; the plan
itself depends on nothing torchtitan-specific.
"""

import math

from torchtitan_seq1f1b.integration.options import Seq1F1B
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = ["Seq1F1BConfigError", "plan_segments"]


class Seq1F1BConfigError(ValueError):
    """A job config Seq1F1B cannot run, found before any collective."""


def plan_segments(options: Seq1F1B, seq_len: int, tp: int, cost: TransformerCost) -> SegmentPlan:
    """The plan ``options`` ask for at ``seq_len`` tokens per sequence.

    Segment lengths are multiples of ``lcm(options.align, tp)`` (sequence
    parallel shards every segment over the TP ranks); ``cost`` prices
    segments for the "balanced" partition. Raises :class:`Seq1F1BConfigError`
    naming the options when no such plan exists.
    """
    align = math.lcm(options.align, tp)
    where = (
        f"seq1f1b.num_segments={options.num_segments}, seq1f1b.partition="
        f"{options.partition!r}, seq1f1b.align={options.align} (x tp={tp}), "
        f"training.seq_len={seq_len}"
    )
    try:
        if options.segment_lengths:
            if sum(options.segment_lengths) != seq_len:
                raise ValueError(
                    f"seq1f1b.segment_lengths={options.segment_lengths} sum to "
                    f"{sum(options.segment_lengths)}, not {seq_len}"
                )
            return SegmentPlan.from_lengths(options.segment_lengths, align)
        if options.num_segments * align > seq_len:
            raise ValueError(
                f"{options.num_segments} segments of at least {align} tokens do not "
                f"fit in {seq_len}; lower num_segments or align"
            )
        if options.partition == "uniform":
            return SegmentPlan.uniform(seq_len, options.num_segments, align)
        return SegmentPlan.balanced(seq_len, options.num_segments, cost, align)
    except ValueError as error:
        raise Seq1F1BConfigError(f"{where}: {error}") from None

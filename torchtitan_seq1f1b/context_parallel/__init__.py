# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Context parallelism inside Seq1F1B segments (see :mod:`.layout`)."""

from torchtitan_seq1f1b.context_parallel.collectives import (
    ContextGroup,
    gather_segment,
    reduce_scatter_segment,
)
from torchtitan_seq1f1b.context_parallel.layout import (
    check_context_parallel,
    context_parallel_align,
    HeadTail,
)

__all__ = [
    "ContextGroup",
    "HeadTail",
    "check_context_parallel",
    "context_parallel_align",
    "gather_segment",
    "reduce_scatter_segment",
]

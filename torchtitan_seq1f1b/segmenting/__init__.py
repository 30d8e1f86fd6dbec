# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How a sequence is cut into Seq1F1B segments, and what each segment costs."""

from torchtitan_seq1f1b.segmenting.cost import SegmentCost, TransformerCost
from torchtitan_seq1f1b.segmenting.packed import DocumentLengths, PackedDocumentsCost
from torchtitan_seq1f1b.segmenting.segment_plan import nearest_aligned, scaled_seq_len, SegmentPlan

__all__ = [
    "DocumentLengths",
    "PackedDocumentsCost",
    "SegmentCost",
    "SegmentPlan",
    "TransformerCost",
    "nearest_aligned",
    "scaled_seq_len",
]

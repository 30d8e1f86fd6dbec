# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Packed documents measured: attention FLOPs and K/V bytes of Seq1F1B against the dense prefix.

``python -m torchtitan_seq1f1b.tools.documents --help``; the numbers and what
they mean: docs/benchmarks.md, "Packed documents".
"""

from torchtitan_seq1f1b.tools.documents.measure import (
    attention_pairs_per_segment,
    kv_rows_kept,
    rank_kv_peak_rows,
)
from torchtitan_seq1f1b.tools.documents.sampling import sample_document_ids

__all__ = [
    "attention_pairs_per_segment",
    "kv_rows_kept",
    "rank_kv_peak_rows",
    "sample_document_ids",
]

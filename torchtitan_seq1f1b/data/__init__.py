# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The embedded default corpus (long-range recall) and its word-level tokenizer."""

from torchtitan_seq1f1b.data.make_tokenizer import TOKENIZER_DIR, VOCAB_SIZE
from torchtitan_seq1f1b.data.recall import (
    RecallSpec,
    dependent_mask,
    full_attention_bound,
    load_recall,
    no_cross_segment_bound,
    recall_document,
)
from torchtitan_seq1f1b.data.register import (
    DATASET_NAMES,
    register_datasets,
    resolve_hf_assets_path,
)

__all__ = [
    "DATASET_NAMES",
    "TOKENIZER_DIR",
    "VOCAB_SIZE",
    "RecallSpec",
    "dependent_mask",
    "full_attention_bound",
    "load_recall",
    "no_cross_segment_bound",
    "recall_document",
    "register_datasets",
    "resolve_hf_assets_path",
]

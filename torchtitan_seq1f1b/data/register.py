# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Make the recall corpus and the shipped tokenizer usable from torchtitan TOML.

    [model]
    hf_assets_path = "./torchtitan_seq1f1b/assets/tokenizer"   # see resolve_hf_assets_path
    [training]
    dataset = "seq1f1b_recall"        # dataset_path = "doc_tokens=513" for seq_len 512
    [validation]
    dataset = "seq1f1b_recall_validation"
"""

import os
from functools import partial
from pathlib import Path

from torchtitan_seq1f1b.data.make_tokenizer import TOKENIZER_DIR
from torchtitan_seq1f1b.data.recall import RecallSpec, load_recall, sample_text

__all__ = ["DATASET_NAMES", "register_datasets", "resolve_hf_assets_path"]

DATASET_NAMES = {"seq1f1b_recall": "train", "seq1f1b_recall_validation": "validation"}

# The repo-relative spelling a TOML uses when run from a checkout.
_RELATIVE_TOKENIZER_DIR = Path("torchtitan_seq1f1b") / "assets" / "tokenizer"


def register_datasets() -> None:
    """Add the recall corpus to torchtitan's DATASETS; calling again is a no-op.

    torchtitan looks names up in that module-level dict when it builds the
    dataloader, so this must run first in every rank's process. The default
    path is the default :class:`RecallSpec`; ``dataset_path`` overrides it.
    torchtitan 0.2 and 0.3 only: main's datasets are config objects
    (:mod:`.grain_source`).
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name, split in DATASET_NAMES.items():
        DATASETS[name] = DatasetConfig(
            path=RecallSpec().to_path(),
            loader=partial(load_recall, split=split),
            sample_processor=sample_text,
        )


def resolve_hf_assets_path(path: str) -> str:
    """``path`` if it exists from the working dir, else the shipped tokenizer dir
    when ``path`` names it (``torchtitan_seq1f1b/assets/tokenizer``, with any
    leading ``./``); otherwise ``path`` unchanged, for torchtitan to report.

    A TOML's relative hf_assets_path only works from a checkout's root; an
    installed package lives elsewhere, so the trainer maps it here.
    """
    if os.path.isdir(path):
        return path
    if Path(os.path.normpath(path)) == _RELATIVE_TOKENIZER_DIR:
        return str(TOKENIZER_DIR)
    return path

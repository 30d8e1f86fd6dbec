# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A job's data and tokenizer: its own, or a corpus this package ships (``seq1f1b.data``).

torchtitan's debug configs read its repository's test assets
(``./tests/assets/tokenizer``, the ``c4_test`` and ``cc12m-test`` samples),
which a pip install does not have. ``--seq1f1b.data recall`` swaps in the
recall corpus and the shipped tokenizer, ``--seq1f1b.data images`` the
synthetic image-text corpus (:mod:`.image_dataloader` on 0.3,
:mod:`.image_grain` on main) for a vision-language model; otherwise a missing
local path is refused at start-up, naming the option to set.
"""

import dataclasses
import os
from typing import Any

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.trainer import Trainer

from torchtitan_seq1f1b.data import DATASET_NAMES, RecallSpec, TOKENIZER_DIR
from torchtitan_seq1f1b.integration.titan_0_3.image_corpus import VisionSettings
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

if FOLDED:  # torchtitan main: Grain datasets are config objects
    from torchtitan.components.data import GrainDataLoader

    from torchtitan_seq1f1b.data.grain_source import recall_dataset, RecallSource
    from torchtitan_seq1f1b.integration.titan_0_3.image_grain import image_loader
else:
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader

    from torchtitan_seq1f1b.integration.titan_0_3.image_dataloader import (
        IMAGE_DATASET,
        ImageTextDataLoader,
    )

__all__ = [
    "data_problems",
    "dataset_name_and_path",
    "recall_loader",
    "use_image_data",
    "use_recall_data",
]



_TRAIN, _VALIDATION = DATASET_NAMES  # "seq1f1b_recall", "seq1f1b_recall_validation"


def _recall_path(path: str | None) -> str | None:
    """``path`` if it selects a recall corpus (``"doc_tokens=41,words=64"``), else None."""
    try:
        RecallSpec.parse(path)
    except ValueError:
        return None
    return path


def recall_loader(split: str, corpus: str | None = None):
    """The recall corpus' ``split`` ("train", repeated, or "validation", read once) as
    the installed torchtitan's dataloader config; ``corpus``: :class:`RecallSpec`
    overrides (``"doc_tokens=41,words=64"``), None for the defaults."""
    train = split == "train"
    if FOLDED:
        return GrainDataLoader.Config(dataset=recall_dataset(corpus or "", split), repeat=train)
    return HuggingFaceTextDataLoader.Config(
        dataset=_TRAIN if train else _VALIDATION, dataset_path=corpus, infinite=train
    )


def use_recall_data(config: Trainer.Config) -> None:
    """Train and validate on the recall corpus, tokenized by the shipped tokenizer; a
    ``dataset_path`` that selects a recall corpus (``--dataloader.dataset_path
    doc_tokens=41``) stays (main has no such flag: its default corpus)."""
    config.hf_assets_path = str(TOKENIZER_DIR)
    # Plain: the shipped tokenizer has no image tokens for a multimodal one to find.
    config.tokenizer = HuggingFaceTokenizer.Config()
    own_path = getattr(config.dataloader, "dataset_path", None)
    config.dataloader = recall_loader("train", _recall_path(own_path))
    if config.validator is not None:
        own_path = getattr(config.validator.dataloader, "dataset_path", None)
        config.validator.dataloader = recall_loader("validation", _recall_path(own_path))


def use_image_data(config: Trainer.Config) -> None:
    """Train on the image-text corpus, batched with the vision settings of the job's
    multimodal dataloader, its token ids those of the shipped tokenizer. The job
    validates on nothing: the corpus has no end to validate over."""
    # main keeps the vision settings on the dataloader's collator.
    own = config.dataloader.collator if FOLDED else config.dataloader
    tokens = config.tokenizer
    settings = {f.name: getattr(own, f.name) for f in dataclasses.fields(VisionSettings)
                if hasattr(own, f.name)}
    # One placeholder for images and videos, as kimi_k2_5's tokenizer has.
    settings["shared_placeholder"] = (
        getattr(tokens, "image_token", None) == getattr(tokens, "video_token", "")
    )
    config.hf_assets_path = str(TOKENIZER_DIR)
    config.tokenizer = HuggingFaceTokenizer.Config()
    vision = VisionSettings(**settings)
    config.dataloader = image_loader(vision) if FOLDED else ImageTextDataLoader.Config(vision=vision)
    if config.validator is not None:
        config.validator.enable = False


def dataset_name_and_path(loader: Any) -> tuple[str, str | None]:
    """A dataloader config's dataset as 0.3 names it (``"seq1f1b_recall"`` and its
    path for the recall corpus); main's Grain recall dataset is named the same."""
    if not FOLDED:
        return getattr(loader, "dataset", ""), getattr(loader, "dataset_path", None)
    source = getattr(getattr(getattr(loader, "dataset", None), "dataset", None), "source", None)
    if isinstance(source, RecallSource.Config):
        return (_TRAIN if source.split == "train" else _VALIDATION), source.spec
    return "", None


def _is_local(path: str) -> bool:
    # A hub dataset is "owner/name"; anything else names a directory.
    return path.startswith((".", "/", "~")) or path.count("/") != 1


def data_problems(config: Trainer.Config) -> list[str]:
    """Each data option naming a local path that does not exist, with the fix."""
    fix = "or --seq1f1b.data recall to train on the corpus and tokenizer this package ships"
    problems = []
    if not os.path.isdir(config.hf_assets_path):
        problems.append(
            f"hf_assets_path={config.hf_assets_path!r} does not exist (torchtitan's debug "
            f"configs point at its repository's tests/assets); set --hf_assets_path, {fix}"
        )
    if FOLDED:  # a Grain dataset is an object, not a path to check
        return problems
    loaders = [("dataloader", config.dataloader)]
    if config.validator is not None and getattr(config.validator, "enable", False):
        loaders.append(("validator.dataloader", config.validator.dataloader))
    for option, loader in loaders:
        if getattr(loader, "dataset", None) in (*DATASET_NAMES, IMAGE_DATASET):
            continue  # generated: its path holds the corpus' parameters
        dataset = DATASETS.get(getattr(loader, "dataset", None))
        path = loader.dataset_path or (dataset.path if dataset is not None else None)
        if path and _is_local(path) and not os.path.exists(os.path.expanduser(path)):
            problems.append(
                f"{option}.dataset={loader.dataset!r} reads {path!r}, which does not exist; "
                f"set --{option}.dataset_path, {fix}"
            )
    return problems

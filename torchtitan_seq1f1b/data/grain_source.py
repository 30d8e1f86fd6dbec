# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The recall corpus as a torchtitan main (Grain) dataset.

torchtitan main's datasets are config objects, not names: a source, a
processor that tokenizes and shifts, and a packing that cuts the token
stream into microbatch rows with positions restarting at every document::

    GrainDataLoader.Config(dataset=recall_dataset("doc_tokens=129,words=64"))
"""

from dataclasses import dataclass
from typing import Any

from torchtitan.components.data import ConcatThenSplitPackingConfig, SingleDatasetConfig
from torchtitan.components.data.types import DatasetIterationPolicy
from torchtitan.config import Configurable
from torchtitan.hf_datasets.text_datasets import TextProcessor

from torchtitan_seq1f1b.data.recall import recall_document, RecallSpec, split_size

__all__ = ["RecallSource", "recall_dataset"]


class RecallSource(Configurable):
    """Random access to the recall corpus' documents, ``{"text": str}`` each."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        spec: str = ""
        """:class:`RecallSpec` overrides, as a 0.3 ``dataset_path`` gives them."""
        split: str = "train"

    def __init__(self, config: Config, *, dataset_iteration_policy: DatasetIterationPolicy):
        del dataset_iteration_policy  # the dataset node shuffles, repeats and shards
        self._spec = RecallSpec.parse(config.spec)
        self._split = config.split
        self._size = split_size(self._spec, config.split)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"text": recall_document(self._spec, self._split, index)}


def recall_dataset(spec: str = "", split: str = "train") -> ConcatThenSplitPackingConfig:
    """The corpus tokenized (BOS and EOS around every document) and packed into rows
    of the job's tokens per microbatch; a document of ``doc_tokens`` tokens takes
    ``doc_tokens - 1`` of them (inputs and labels are shifted)."""
    source = RecallSource.Config(spec=spec, split=split)
    return ConcatThenSplitPackingConfig(
        dataset=SingleDatasetConfig(source=source, processor=TextProcessor.Config())
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The synthetic image-text corpus as a torchtitan main (Grain) dataloader
(``--seq1f1b.data images``).

main's datasets are config objects: a random-access source of shifted samples
(:class:`ImageTextSource`, rows of :mod:`.image_corpus`), packed whole into
rows of the job's tokens per microbatch by torchtitan's own
``MMSamplePackingConfig`` (:class:`ImageTextDataset`) and collated by its
``MultiModalCollator`` (:class:`ImageTextCollator`), both with the corpus'
special token ids. A document is ``training.max_context_length`` tokens long,
its token ids below the job tokenizer's vocabulary::

    GrainDataLoader.Config(dataset=corpus, collator=ImageTextCollator.Config(corpus=corpus))
"""

from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.data import GrainDataLoader, SingleDatasetConfig
from torchtitan.components.data.collators import Collator, TrainerBatch
from torchtitan.components.data.types import DatasetBuildContext, DatasetIterationPolicy
from torchtitan.config import Configurable

from torchtitan_seq1f1b.integration.titan_0_3.image_corpus import (
    image_text_collator,
    image_text_context,
    image_text_row,
    ImageTextSpec,
    VisionSettings,
)
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import torchvision_stand_in

__all__ = ["ImageTextCollator", "ImageTextDataset", "ImageTextSource", "image_loader"]

# The corpus has no end; the dataset node shuffles, shards and repeats this many rows.
ROWS = 1 << 20


class ImageTextSource(Configurable):
    """Random access to the corpus' rows, each a shifted multimodal sample."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        spec: ImageTextSpec = field(default_factory=ImageTextSpec)

    def __init__(self, config: Config, *, dataset_iteration_policy: DatasetIterationPolicy):
        del dataset_iteration_policy  # the dataset node shuffles, repeats and shards
        self._spec = config.spec

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, Any]:
        return image_text_row(self._spec, index)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageTextDataset:
    """The corpus as a Grain dataset config: whole documents packed into rows."""

    images_per_row: int = 2
    """Images per document, each opening a chunk whose last token names its colour."""
    seed: int = 0
    vision: VisionSettings = field(default_factory=VisionSettings)
    """The model's image batching (its own multimodal collator's settings)."""

    def spec(self, context: DatasetBuildContext) -> ImageTextSpec:
        """The corpus of a job: documents of its context length, its tokenizer's ids."""
        return ImageTextSpec(
            seq_len=context.max_context_length,
            images_per_row=self.images_per_row,
            vocab=context.tokenizer.get_vocab_size(),
            seed=self.seed,
            vision=self.vision,
        )

    def build(self, *, context: DatasetBuildContext,
              dataset_iteration_policy: DatasetIterationPolicy):
        spec = self.spec(context)
        with torchvision_stand_in():  # its module imports torchvision to decode images
            from torchtitan.hf_datasets.multimodal.mm_datasets import MMSamplePackingConfig

        documents = SingleDatasetConfig(source=ImageTextSource.Config(spec=spec))
        return MMSamplePackingConfig(dataset=documents).build(
            # Padding takes the corpus' pad id, not the tokenizer's.
            context=image_text_context(spec, context.num_tokens_per_batch),
            dataset_iteration_policy=dataset_iteration_policy,
        )


class ImageTextCollator(Collator):
    """torchtitan's ``MultiModalCollator`` with the corpus' special token ids."""

    @dataclass(kw_only=True, slots=True)
    class Config(Collator.Config):
        corpus: ImageTextDataset = field(default_factory=ImageTextDataset)

    def __init__(self, config: Config, *, context: DatasetBuildContext) -> None:
        spec = config.corpus.spec(context)
        self._collate = image_text_collator(spec, context.num_tokens_per_batch)

    def __call__(self, rows: list[dict[str, Any]]) -> TrainerBatch:
        return self._collate(rows)


def image_loader(vision: VisionSettings) -> GrainDataLoader.Config:
    """The corpus batched with a model's ``vision`` settings, repeated without end."""
    corpus = ImageTextDataset(vision=vision)
    return GrainDataLoader.Config(
        dataset=corpus, collator=ImageTextCollator.Config(corpus=corpus), repeat=True
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The synthetic image-text corpus as a torchtitan 0.3 dataloader (``--seq1f1b.data images``).

torchtitan's ``cc12m-test`` images live in its repository, not in the wheel,
and its multimodal dataloader decodes them with torchvision. This one makes
the rows of :mod:`.image_corpus` and batches them with torchtitan's own
collator, so a VLM job sees the batches its dataloader would give: each
data-parallel rank reads rows ``dp_rank, dp_rank + dp_world_size, ...``.
"""

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from torchtitan_seq1f1b.integration.titan_0_3.image_corpus import (
    image_text_collator,
    image_text_row,
    ImageTextSpec,
    VisionSettings,
)

__all__ = ["IMAGE_DATASET", "ImageTextDataLoader"]

IMAGE_DATASET = "seq1f1b_images"


class _ImageTextRows(IterableDataset, Stateful):
    """Rows ``first, first + stride, ...`` of the corpus, without end."""

    def __init__(self, spec: ImageTextSpec, first: int, stride: int):
        self.spec, self.stride = spec, stride
        self.next_index = first

    def __iter__(self):
        while True:
            index, self.next_index = self.next_index, self.next_index + self.stride
            yield image_text_row(self.spec, index)

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_index = state_dict["next_index"]


class ImageTextDataLoader(ParallelAwareDataloader):
    """Batches of the image-text corpus: (input_dict, labels) as torchtitan's
    ``MMDataLoader`` yields them (:mod:`.image_corpus`), of the job's seq_len
    and of token ids below the job tokenizer's vocabulary."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = IMAGE_DATASET
        images_per_row: int = 2
        """Images per row, each opening a chunk whose last token names its colour."""
        seed: int = 0
        vision: VisionSettings = field(default_factory=VisionSettings)
        """The model's image batching (its own multimodal dataloader's settings)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        spec = ImageTextSpec(
            seq_len=seq_len,
            images_per_row=config.images_per_row,
            vocab=tokenizer.get_vocab_size(),
            seed=config.seed,
            vision=config.vision,
        )
        super().__init__(
            _ImageTextRows(spec, dp_rank, dp_world_size),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            collate_fn=image_text_collator(spec, local_batch_size),
            num_workers=config.num_workers,
            pin_memory=config.pin_memory,
        )

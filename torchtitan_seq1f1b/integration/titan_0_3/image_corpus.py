# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A synthetic image-text corpus for torchtitan's VLMs, made at run time (no downloads, no
torchvision).

Every row holds ``images_per_row`` chunks ``<vision_start> <image>*n
<vision_end> filler... colour``: an image of one colour under noise, then
random filler words, the colour's word at the chunk's end. The colour word
can only be predicted by looking back at the image, a chunk's length away,
so under Seq1F1B it often needs an earlier segment's image features.

Rows are made from (seed, index) and batched by the installed torchtitan's own
``MultiModalCollator`` (patches in the model's order, padding, MRoPE positions),
so a batch is what its multimodal dataloader yields for qwen3_5. On torchtitan
0.3: ``input`` (B, T), ``positions`` (B, T), ``pixel_values`` (N, max_patches,
3 * temporal_patch_size * patch_size**2), ``grid_thw`` (N, 3),
``mrope_positions`` (B, T, 3), ``special_tokens``, and labels (B, T). On main,
whose collator packs whole samples into one row and does not shift: ``input``,
``positions`` and labels (T,), ``pixel_values`` (num_patches, patch_dim),
``mrope_positions`` (T, 3). For kimi patches in raster order, no MRoPE and one
placeholder id.
"""

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import torchvision_stand_in

__all__ = [
    "ImageTextSpec",
    "VisionSettings",
    "image_text_batch",
    "image_text_collator",
    "image_text_context",
    "image_text_row",
]


@dataclass(frozen=True)
class VisionSettings:
    """A model's image batching, as the fields of torchtitan's ``MMDataLoader.Config``
    (qwen3_5's by default); ``shared_placeholder``: images and videos share one
    placeholder id (kimi_k2_5's ``<|media_pad|>``), else there are no video tokens."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    patch_order: str = "block"
    build_mrope_positions: bool = True
    shared_placeholder: bool = False


@dataclass(frozen=True)
class ImageTextSpec:
    """The corpus and qwen3_5's vision settings (its debugmodel's by default).

    seq_len: tokens per input row (rows are made ``seq_len + 1`` long and shifted).
    images_per_row: images, each in its own chunk of ``(seq_len + 1) // images_per_row``
        tokens (the last chunk takes the remainder).
    grids: image sizes in patches ``(h, w)``, each image's drawn from these;
        multiples of ``spatial_merge_size``.
    colours: distinct colours; colour c's word is token id c.
    texture: amplitude of the uniform noise added to an image's colour, so that
        every patch differs (0: solid colours).
    vocab: token ids are below it; the top four are vision_start, vision_end,
        image and pad, the ids in between filler words.
    seed: corpus seed; rows differ for every (seed, index).
    vision: the model's image batching.
    """

    seq_len: int = 128
    images_per_row: int = 2
    grids: tuple[tuple[int, int], ...] = ((4, 4), (2, 4))
    colours: int = 8
    texture: float = 0.5
    vocab: int = 2048
    seed: int = 0
    vision: VisionSettings = VisionSettings()

    def __post_init__(self):
        merge = self.vision.spatial_merge_size
        if any(h % merge or w % merge for h, w in self.grids):
            raise ValueError(f"grids {self.grids} must be multiples of spatial_merge_size {merge}")
        if not 1 <= self.colours < self.vocab - 4:  # leaves a filler word
            raise ValueError(f"colours must be in [1, vocab - 5], got {self.colours}")
        # A chunk needs its image with both markers, one filler word and the colour word.
        shortest = self.image_tokens(max(self.grids, key=lambda g: g[0] * g[1])) + 4
        if (self.seq_len + 1) // self.images_per_row < shortest:
            raise ValueError(
                f"seq_len {self.seq_len} has no room for {self.images_per_row} chunks of "
                f">= {shortest} tokens"
            )

    @property
    def special_tokens(self) -> dict[str, int]:
        """The token ids of torchtitan's MultiModalTokenizer fields."""
        top = self.vocab - 1
        video = top - 1 if self.vision.shared_placeholder else -1
        return {"vision_start_id": top - 3, "vision_end_id": top - 2, "image_id": top - 1,
                "pad_id": top, "video_id": video}

    @property
    def filler_ids(self) -> range:
        return range(self.colours, self.vocab - 4)

    def image_tokens(self, grid: tuple[int, int]) -> int:
        """Tokens of an image of ``grid`` patches: qwen3_5 merges merge**2 patches into one."""
        return grid[0] * grid[1] // self.vision.spatial_merge_size**2

    def palette(self) -> torch.Tensor:
        """(colours, 3) float32 RGB in [-1, 1], the range of torchtitan's normalized pixels."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.colours, 3, generator=generator) * 2 - 1


class _Tokenizer:
    """What MultiModalCollator reads off a tokenizer: the special tokens' ids."""

    TOKEN_FIELDS = ("image", "video", "vision_start", "vision_end", "pad")

    def __init__(self, special_tokens: dict[str, int]):
        self.__dict__.update(special_tokens)


def image_text_row(spec: ImageTextSpec, index: int) -> dict[str, Any]:
    """Row ``index`` as the installed torchtitan's multimodal sample.

    Returns ``input_ids``, ``labels`` (vision tokens IGNORE_INDEX) and ``positions``,
    each int64, (seq_len + 1,) on 0.3, whose collator shifts, and shifted,
    (seq_len,), on main; and ``pixel_values``: one (1, H, W, 3) float32 image per
    chunk, H and W the grid's patches times ``patch_size``.
    """
    # A string seed hashes with SHA-512: the same row on every platform and run.
    rng = random.Random(f"seq1f1b-images/{spec.seed}/{index}")
    ids, palette = spec.special_tokens, spec.palette()
    chunk = (spec.seq_len + 1) // spec.images_per_row
    tokens, images = [], []
    for i in range(spec.images_per_row):
        length = chunk if i < spec.images_per_row - 1 else spec.seq_len + 1 - len(tokens)
        grid, colour = rng.choice(spec.grids), rng.randrange(spec.colours)
        run = spec.image_tokens(grid)
        filler = [rng.choice(spec.filler_ids) for _ in range(length - run - 3)]
        # The colour word ends the chunk: as far from its image as the chunk allows.
        tokens += [ids["vision_start_id"], *[ids["image_id"]] * run, ids["vision_end_id"],
                   *filler, colour]
        h, w = (n * spec.vision.patch_size for n in grid)
        # Texture on the colour: every patch of every image differs.
        noise = torch.Generator().manual_seed(rng.getrandbits(63))
        texture = torch.rand(1, h, w, 3, generator=noise) - 0.5
        images.append((palette[colour] + spec.texture * texture).clamp(-1, 1))
    input_ids = torch.tensor(tokens)
    vision = torch.tensor([ids["vision_start_id"], ids["vision_end_id"], ids["image_id"]])
    labels = input_ids.masked_fill(torch.isin(input_ids, vision), IGNORE_INDEX)
    if FOLDED:  # main's collator takes samples shifted
        input_ids, labels = input_ids[:-1], labels[1:]
    return {"input_ids": input_ids, "labels": labels, "positions": torch.arange(len(input_ids)),
            "pixel_values": images}


def image_text_context(spec: ImageTextSpec, num_tokens: int):
    """torchtitan main's ``DatasetBuildContext`` for ``spec``: documents of up to seq_len
    tokens packed into rows of ``num_tokens``, the tokenizer the corpus' special tokens."""
    import grain.python as grain
    from torchtitan.components.data.types import DatasetBuildContext

    return DatasetBuildContext(
        tokenizer=_Tokenizer(spec.special_tokens),
        max_context_length=spec.seq_len,
        num_tokens_per_batch=num_tokens,
        read_options=grain.ReadOptions(),
    )


def image_text_collator(spec: ImageTextSpec, batch_size: int):
    """torchtitan's MultiModalCollator for ``batch_size`` rows of ``spec`` (on main:
    one packed row of ``batch_size`` tokens): patches in the model's order,
    padding, MRoPE positions if the model takes them."""
    # Its module imports torchvision to decode images; made ones need no decoding.
    with torchvision_stand_in():
        from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator

    vision = dataclasses.asdict(spec.vision)
    del vision["shared_placeholder"]  # the tokenizer's ids say it
    if FOLDED:
        # A packed row holds at most ceil(batch_size / seq_len) whole documents.
        documents = -(-batch_size // spec.seq_len)
        return MultiModalCollator(
            MultiModalCollator.Config(max_images_per_batch=documents * spec.images_per_row,
                                      **vision),
            context=image_text_context(spec, batch_size),
        )
    return MultiModalCollator(
        batch_size=batch_size,
        seq_len=spec.seq_len,
        max_images_per_batch=batch_size * spec.images_per_row,
        tokenizer=_Tokenizer(spec.special_tokens),
        **vision,
    )


def image_text_batch(
    spec: ImageTextSpec, indices: Sequence[int]
) -> tuple[dict[str, Any], torch.Tensor]:
    """Rows ``indices`` collated as torchtitan's multimodal dataloader yields them:
    (input_dict, labels (B, seq_len)), on main one packed row (B * seq_len,); see
    the module doc."""
    rows = [image_text_row(spec, i) for i in indices]
    return image_text_collator(spec, len(indices) * (spec.seq_len if FOLDED else 1))(rows)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The synthetic image-text corpus: batches as the installed torchtitan's multimodal
dataloader yields them for qwen3_5, rows (B, T) on 0.3, one packed row (B * T,) on
main (the models train on it in test_qwen3_5.py and test_models.py)."""

import dataclasses

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.models.common.multimodal import get_vision_positions

from torchtitan_seq1f1b.integration.titan_0_3.image_corpus import ImageTextSpec, image_text_batch, image_text_row
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

SPEC = ImageTextSpec(seq_len=64)
INDICES = [0, 1, 2, 3]
# The batch's token shape: main packs its rows into one.
TOKENS = (len(INDICES) * SPEC.seq_len,) if FOLDED else (len(INDICES), SPEC.seq_len)


def _row(inputs: dict, i: int) -> torch.Tensor:
    """Row i's input tokens in a batch."""
    return inputs["input"][i * SPEC.seq_len:(i + 1) * SPEC.seq_len] if FOLDED else inputs["input"][i]


@pytest.fixture(scope="module")
def batch():
    return image_text_batch(SPEC, INDICES)


def test_shapes_and_dtypes(batch):
    inputs, labels = batch
    n = len(INDICES) * SPEC.images_per_row
    patch_dim = 3 * SPEC.vision.temporal_patch_size * SPEC.vision.patch_size**2
    max_patches = max(h * w for h, w in SPEC.grids)
    assert inputs["input"].shape == labels.shape == inputs["positions"].shape == TOKENS
    assert inputs["input"].dtype == labels.dtype == torch.int64
    assert inputs["pixel_values"].dtype == torch.float32
    assert inputs["pixel_values"].shape[-1] == patch_dim
    if FOLDED:  # every image's patches, packed
        assert inputs["pixel_values"].shape[0] == inputs["grid_thw"].prod(-1).sum()
    else:
        assert inputs["pixel_values"].shape[0] == n
        assert inputs["pixel_values"].shape[1] <= max_patches
        assert inputs["pixel_values"].shape[1] % SPEC.vision.spatial_merge_size**2 == 0
    assert inputs["grid_thw"].shape == (n, 3) and inputs["grid_thw"].dtype == torch.int64
    assert (inputs["grid_thw"][:, 0] == 1).all()  # one frame, padded to temporal_patch_size
    assert inputs["mrope_positions"].shape == (*TOKENS, 3)
    assert inputs["mrope_positions"].dtype == torch.int64
    assert inputs["pixel_values_videos"] is None and inputs["grid_thw_videos"] is None
    assert inputs["special_tokens"]["image_id"] == SPEC.special_tokens["image_id"]


def test_image_runs_match_merged_patches(batch):
    """torchtitan's own check: one image-token run per image, of its merged patch count."""
    inputs, labels = batch
    merged = inputs["grid_thw"].prod(-1) // SPEC.vision.spatial_merge_size**2
    image_id = inputs["special_tokens"]["image_id"]
    runs = get_vision_positions(inputs["input"], merged, image_id)
    assert [n for *_, n in runs] == merged.tolist()
    assert (labels[inputs["input"] == image_id] == IGNORE_INDEX).all()


def test_mrope_positions_of_text_and_images(batch):
    inputs, _ = batch
    mrope, image = inputs["mrope_positions"], inputs["input"] == SPEC.special_tokens["image_id"]
    # Text tokens share one position on all three axes; image tokens span a grid.
    assert (mrope[~image] == mrope[~image][:, :1]).all()
    assert (mrope[image][:, 1:] != mrope[image][:, :1]).any()
    # Every row starts at 0 (main restarts them where a packed row's document starts).
    assert (mrope.view(len(INDICES), SPEC.seq_len, 3)[:, 0] == 0).all()


def test_deterministic_and_row_wise():
    first, _ = image_text_batch(SPEC, INDICES)
    again, _ = image_text_batch(SPEC, INDICES)
    for key in ("input", "pixel_values", "grid_thw", "mrope_positions"):
        assert torch.equal(first[key], again[key])
    # Row 2 does not depend on its batch: DP sharding and resumption see the same row.
    alone, _ = image_text_batch(SPEC, [2])
    assert torch.equal(_row(alone, 0), _row(first, 2))
    other, _ = image_text_batch(dataclasses.replace(SPEC, seed=1), INDICES)
    assert not torch.equal(other["input"], first["input"])


def test_chunk_ends_name_their_images_colour():
    """The label that ends each chunk is the colour word of the chunk's image's pixels:
    its colour under noise of at most texture / 2, every pixel its own."""
    palette = SPEC.palette()
    for index in INDICES:
        row = image_text_row(SPEC, index)
        # The whole chunk: main's sample is shifted, its last token the last label.
        tokens = torch.cat([row["input_ids"], row["labels"][-1:]]) if FOLDED else row["input_ids"]
        starts = (tokens == SPEC.special_tokens["vision_start_id"]).nonzero().flatten().tolist()
        ends = [*starts[1:], len(tokens)]
        for end, image in zip(ends, row["pixel_values"], strict=True):
            colour = int(tokens[end - 1])
            assert colour < SPEC.colours
            assert ((image - palette[colour]).abs() <= SPEC.texture / 2).all()
            assert len(image.flatten(0, 2).unique(dim=0)) == image[0].flatten(0, 1).shape[0]

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The synthetic image-text corpus: batches as torchtitan 0.3's multimodal dataloader
yields them for qwen3_5, and one forward of qwen35_debugmodel on one, on CPU."""

import dataclasses

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.models.common.multimodal import get_vision_positions

from torchtitan_seq1f1b.integration.titan_0_3.image_corpus import ImageTextSpec, image_text_batch, image_text_row

SPEC = ImageTextSpec(seq_len=64)
INDICES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def batch():
    return image_text_batch(SPEC, INDICES)


def test_shapes_and_dtypes(batch):
    inputs, labels = batch
    n = len(INDICES) * SPEC.images_per_row
    patch_dim = 3 * SPEC.vision.temporal_patch_size * SPEC.vision.patch_size**2
    max_patches = max(h * w for h, w in SPEC.grids)
    assert inputs["input"].shape == labels.shape == (len(INDICES), SPEC.seq_len)
    assert inputs["positions"].shape == (len(INDICES), SPEC.seq_len)
    assert inputs["input"].dtype == labels.dtype == torch.int64
    assert inputs["pixel_values"].dtype == torch.float32
    assert inputs["pixel_values"].shape[0] == n and inputs["pixel_values"].shape[2] == patch_dim
    assert inputs["pixel_values"].shape[1] <= max_patches
    assert inputs["pixel_values"].shape[1] % SPEC.vision.spatial_merge_size**2 == 0
    assert inputs["grid_thw"].shape == (n, 3) and inputs["grid_thw"].dtype == torch.int64
    assert (inputs["grid_thw"][:, 0] == 1).all()  # one frame, padded to temporal_patch_size
    assert inputs["mrope_positions"].shape == (len(INDICES), SPEC.seq_len, 3)
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
    assert (mrope[:, 0] == 0).all()


def test_deterministic_and_row_wise():
    first, _ = image_text_batch(SPEC, INDICES)
    again, _ = image_text_batch(SPEC, INDICES)
    for key in ("input", "pixel_values", "grid_thw", "mrope_positions"):
        assert torch.equal(first[key], again[key])
    # Row 2 does not depend on its batch: DP sharding and resumption see the same row.
    alone, _ = image_text_batch(SPEC, [2])
    assert torch.equal(alone["input"][0], first["input"][2])
    other, _ = image_text_batch(dataclasses.replace(SPEC, seed=1), INDICES)
    assert not torch.equal(other["input"], first["input"])


def test_chunk_ends_name_their_images_colour():
    """The label that ends each chunk is the colour word of the chunk's image's pixels:
    its colour under noise of at most texture / 2, every pixel its own."""
    palette = SPEC.palette()
    for index in INDICES:
        row = image_text_row(SPEC, index)
        tokens = row["input_ids"]
        starts = (tokens == SPEC.special_tokens["vision_start_id"]).nonzero().flatten().tolist()
        ends = [*starts[1:], len(tokens)]
        for end, image in zip(ends, row["pixel_values"], strict=True):
            colour = int(tokens[end - 1])
            assert colour < SPEC.colours
            assert ((image - palette[colour]).abs() <= SPEC.texture / 2).all()
            assert len(image.flatten(0, 2).unique(dim=0)) == image[0].flatten(0, 1).shape[0]


def test_qwen35_debugmodel_forward_on_cpu(batch):
    """The batch goes through qwen35_debugmodel's vision encoder and decoder in float32.

    fla's Triton kernels need a GPU, so the GatedDeltaNets are this package's
    plain-torch ones; they take no masks (documents: one per row).
    """
    pytest.importorskip("fla")
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
    from torchtitan.models.qwen3_5 import model_registry

    from torchtitan_seq1f1b.integration.titan_0_3.gated_delta_net import convert_gated_delta_nets

    inputs, _ = batch
    config = model_registry("debugmodel").model
    # The shipped vocabulary's size: the full one's embedding would dominate the test.
    config = dataclasses.replace(
        config,
        vocab_size=SPEC.vocab,
        tok_embeddings=dataclasses.replace(config.tok_embeddings, num_embeddings=SPEC.vocab),
        lm_head=dataclasses.replace(config.lm_head, out_features=SPEC.vocab),
    )
    assert config.vision_encoder.patch_size == SPEC.vision.patch_size
    assert config.vision_encoder.spatial_merge_size == SPEC.vision.spatial_merge_size
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    convert_gated_delta_nets(model)
    masks = model.get_attention_masks(positions=inputs["positions"])
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")  # spmd_types annotations need a device mesh
    try:
        with torch.no_grad():
            embeds, merged = model._get_vision_embeds(
                inputs["pixel_values"], grid_thw=inputs["grid_thw"]
            )
            logits = model(
                inputs["input"],
                pixel_values=inputs["pixel_values"],
                grid_thw=inputs["grid_thw"],
                positions=inputs["positions"],
                mrope_positions=inputs["mrope_positions"],
                attention_masks={"quadratic_attention": masks["quadratic_attention"],
                                 "deltanet": None},
                special_tokens=inputs["special_tokens"],
            )
    finally:
        set_spmd_backend(backend)
    image_id = inputs["special_tokens"]["image_id"]
    runs = get_vision_positions(inputs["input"], merged, image_id)
    assert merged.tolist() == [n for *_, n in runs]
    assert embeds.shape[:2] == (len(merged), int(merged.max()))
    assert logits.shape == (*inputs["input"].shape, SPEC.vocab)
    assert torch.isfinite(logits).all()

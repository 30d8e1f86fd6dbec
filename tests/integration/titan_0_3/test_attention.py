# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The segment-aware attention in torchtitan 0.3's call, against torchtitan's own document mask."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

from torchtitan_seq1f1b.attention import bind_documents
from torchtitan_seq1f1b.integration.titan_0_3.attention import (
    positions_document_ids,
    SegmentAwareInnerAttention,
)

from tests.harness import assert_close, output_and_grads, randn

# Two rows, documents of different lengths starting at different places.
POSITIONS = torch.tensor(
    [
        [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3],
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1],
    ]
)
HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.3


def torchtitan_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: torchtitan's causal AND document mask_mods, evaluated."""
    batch, seq = positions.shape
    causal, document = get_causal_mask_mod(), get_document_mask_mod(positions)
    b = torch.arange(batch)[:, None, None]
    q = torch.arange(seq)[None, :, None]
    kv = torch.arange(seq)[None, None, :]
    return (causal(b, 0, q, kv) & document(b, 0, q, kv))[:, None]


def reference(q, k, v):
    """Explicit attention (batch, seq, heads, head_dim) under torchtitan's mask."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torchtitan_mask(POSITIONS), scale=SCALE, enable_gqa=True
    )
    return out.transpose(1, 2)


def inputs():
    batch, seq = POSITIONS.shape
    q = randn(batch, seq, HEADS, HEAD_DIM, seed=0)
    k = randn(batch, seq, KV_HEADS, HEAD_DIM, seed=1)
    v = randn(batch, seq, KV_HEADS, HEAD_DIM, seed=2)
    return (q, k, v), randn(batch, seq, HEADS, HEAD_DIM, seed=3)


def test_document_ids_are_torchtitans():
    ids = positions_document_ids(POSITIONS)
    assert ids.tolist() == [
        [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2],
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2],
    ]


def test_inner_attention_with_documents_matches_torchtitans_mask():
    layer = SegmentAwareInnerAttention("sdpa")
    bind_documents(layer, positions_document_ids(POSITIONS))
    (q, k, v), grad_out = inputs()
    out, grads = output_and_grads(
        lambda q, k, v: layer(q, k, v, attention_masks=None, scale=SCALE, enable_gqa=True),
        (q, k, v), grad_out,
    )
    ref, ref_grads = output_and_grads(reference, (q, k, v), grad_out)
    assert_close(out, ref, "titan_0_3 attention", what="out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, "titan_0_3 attention", what=f"d{name}")
    # Negative control: plain causal attention is not the document mask.
    bind_documents(layer, None)
    causal = layer(q, k, v, attention_masks=None, scale=SCALE)
    assert (causal - ref).abs().max() > 1e-3


def test_masks_reaching_the_layer_are_refused():
    (q, k, v), _ = inputs()
    with pytest.raises(ValueError, match="got attention_masks"):
        SegmentAwareInnerAttention("sdpa")(q, k, v, attention_masks=object())

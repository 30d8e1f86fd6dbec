# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The segment-aware attention in torchtitan 0.3's call, against torchtitan's own document mask.

On torchtitan main the call takes one packed row, (seq, heads, head_dim): the two rows
below, concatenated.
"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

from torchtitan_seq1f1b.attention import bind_documents
from torchtitan_seq1f1b.integration.titan_0_3.attention import (
    positions_document_ids,
    SegmentAwareInnerAttention,
)
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

from tests.harness import assert_close, output_and_grads, randn

# Two rows, documents of different lengths starting at different places.
POSITIONS = torch.tensor(
    [
        [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3],
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1],
    ]
)
if FOLDED:
    POSITIONS = POSITIONS.flatten()
HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.3


def torchtitan_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: torchtitan's causal AND document mask_mods, evaluated
    (main's on its one row, a batch of one)."""
    rows = positions.view(-1, positions.shape[-1])
    batch, seq = rows.shape
    causal, document = get_causal_mask_mod(), get_document_mask_mod(positions)
    b = torch.arange(batch)[:, None, None]
    q = torch.arange(seq)[None, :, None]
    kv = torch.arange(seq)[None, None, :]
    return (causal(b, 0, q, kv) & document(b, 0, q, kv))[:, None]


def reference(q, k, v):
    """Explicit attention (batch, seq, heads, head_dim), or main's (seq, heads, head_dim),
    under torchtitan's mask."""
    q, k, v = (x.view(-1, *x.shape[-3:]).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torchtitan_mask(POSITIONS), scale=SCALE, enable_gqa=True
    )
    return out.transpose(1, 2).view(*POSITIONS.shape, HEADS, HEAD_DIM)


def inputs():
    shape = POSITIONS.shape
    q = randn(*shape, HEADS, HEAD_DIM, seed=0)
    k = randn(*shape, KV_HEADS, HEAD_DIM, seed=1)
    v = randn(*shape, KV_HEADS, HEAD_DIM, seed=2)
    return (q, k, v), randn(*shape, HEADS, HEAD_DIM, seed=3)


def test_document_ids_are_torchtitans():
    ids = positions_document_ids(POSITIONS)
    rows = [
        [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2],
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2],
    ]
    # main's one row: the second row's documents follow the first's three.
    assert ids.tolist() == ([rows[0] + [i + 3 for i in rows[1]]] if FOLDED else rows)


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

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The vision encoders' attention computed densely on CPU, against each image's own
attention over its real patches (float64), with torchtitan's block mask: on 0.3 over
images padded to the longest, on main over all images packed into one sequence."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.integration.titan_0_3.vision_attention import (
    DenseMaskAttention,
    dense_vision_attention,
)

if FOLDED:
    from torchtitan.models.common.vision_encoder import create_block_diagonal_mask
else:
    from torchtitan.models.common.vision_encoder import get_vision_block_mask_mod

PATCHES = torch.tensor([5, 8, 3])  # real patches per image, padded to 8 on 0.3
HEADS, HEAD_DIM = 2, 4
STARTS = torch.cumsum(PATCHES, 0) - PATCHES  # each image's first patch, packed on main


def _inputs():
    """q, k, v: (images, 8, HEADS, HEAD_DIM) on 0.3, (16, HEADS, HEAD_DIM) on main."""
    gen = torch.Generator().manual_seed(0)
    patches = (int(PATCHES.sum()),) if FOLDED else (len(PATCHES), int(PATCHES.max()))
    return [torch.randn(*patches, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64,
                        requires_grad=True) for _ in range(3)]


def _block_mask():
    if FOLDED:
        return create_block_diagonal_mask(PATCHES, int(PATCHES.sum()), torch.device("cpu"))
    p = int(PATCHES.max())
    return create_block_mask(
        get_vision_block_mask_mod(PATCHES), len(PATCHES), None, p, p, device="cpu"
    )


def _image(x: torch.Tensor, i: int) -> torch.Tensor:
    """Image i's real patches of an _inputs()-shaped x: (PATCHES[i], HEADS, HEAD_DIM)."""
    if FOLDED:
        return x[STARTS[i] : STARTS[i] + PATCHES[i]]
    return x[i, : PATCHES[i]]


def test_matches_each_images_own_attention():
    q, k, v = _inputs()
    out = DenseMaskAttention()(q, k, v, attention_masks=_block_mask())
    for i, n in enumerate(PATCHES.tolist()):
        own = F.scaled_dot_product_attention(
            *(_image(x, i).transpose(0, 1) for x in (q, k, v))
        ).transpose(0, 1)
        torch.testing.assert_close(_image(out, i), own, rtol=1e-12, atol=1e-14)
        if not FOLDED:  # main packs images without padding
            assert (out[i, n:] == 0).all()  # padding attends to nothing, as under flex


def test_gradients_are_finite_and_exact():
    mask = _block_mask()
    assert torch.autograd.gradcheck(
        lambda q, k, v: DenseMaskAttention()(q, k, v, attention_masks=mask), _inputs()
    )
    q, k, v = _inputs()
    DenseMaskAttention()(q, k, v, attention_masks=mask).sum().backward()
    assert all(x.grad.isfinite().all() for x in (q, k, v))
    if not FOLDED:
        assert (k.grad[2, 3:] == 0).all()  # padded keys get nothing


def test_swaps_every_vision_attention():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.flex_attention = torch.nn.Identity()

    model = torch.nn.Sequential(Attention(), torch.nn.Linear(2, 2), Attention())
    assert dense_vision_attention(model) == 2
    assert all(isinstance(m.flex_attention, DenseMaskAttention) for m in (model[0], model[2]))

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's vision encoders made trainable on a machine without an accelerator.

qwen3_5's and kimi_k2_5's encoders attend through ``FlexAttention`` with a
block mask (each image's patches attend to each other, padding to nothing),
and torch's flex attention has no backward on CPU ("FlexAttention does not
support backward on CPU"). :func:`dense_vision_attention` swaps each
encoder's inner attention for :class:`DenseMaskAttention`, which evaluates
the same block mask densely and computes the same softmax attention; rows
the mask leaves empty give zeros, as flex attention's do. On torchtitan main
the encoders pack every item into one sequence, (T, heads, head_dim), under
a block-diagonal mask.
"""

import functools
import math

import torch
import torch.nn as nn

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

__all__ = ["DenseMaskAttention", "dense_vision_attention", "with_dense_vision_attention"]


def _dense(q, k, v, block_mask, scale: float | None) -> torch.Tensor:
    """q, k, v: (N, P, heads, head_dim), N items of P patches; block_mask: a flex
    ``BlockMask`` over (N, P, P) whose mask_mod ignores the head. Returns q's shape."""
    n, p = q.shape[:2]
    arange = torch.arange(p, device=q.device)
    allowed = block_mask.mask_mod(
        torch.arange(n, device=q.device)[:, None, None], 0, arange[:, None], arange[None, :]
    ).expand(n, p, p)[:, None]  # (N, 1, P, P): main's mask_mod ignores the item too
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    # A finite fill: an empty row's softmax stays finite, and its output is zeroed.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhqk,nkhd->nqhd", weights, v)
    has_keys = allowed.any(-1).transpose(1, 2)[..., None]  # (N, P, 1, 1)
    return torch.where(has_keys, out, torch.zeros_like(out))


class DenseMaskAttention(nn.Module):
    """Softmax attention under a flex ``BlockMask``, evaluated densely (CPU sizes)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_masks,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q, k, v: (N, P, heads, head_dim), N items of P patches, on main (P, heads,
        head_dim), all items packed; attention_masks: their flex ``BlockMask``.
        Returns q's shape."""
        if FOLDED:  # the packed sequence as one item
            return _dense(q[None], k[None], v[None], attention_masks, scale)[0]
        return _dense(q, k, v, attention_masks, scale)


def dense_vision_attention(model: nn.Module) -> int:
    """Swap the flex attention of every vision-encoder attention layer (a module with
    a ``flex_attention`` child, torchtitan's ``VisionAttention``) in ``model``;
    returns how many."""
    swapped = 0
    for module in model.modules():
        if isinstance(getattr(module, "flex_attention", None), nn.Module):
            module.flex_attention = DenseMaskAttention()
            swapped += 1
    return swapped


def with_dense_vision_attention(parallelize_fn):
    """``parallelize_fn`` that first makes a model's (or pipeline part's) vision
    encoder attend densely (:func:`dense_vision_attention`)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs) -> nn.Module:
        dense_vision_attention(model)
        return parallelize_fn(model, **kwargs)

    return parallelize

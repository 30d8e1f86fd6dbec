# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Masked-softmax attention in plain torch ops, forward and backward written out.

What the registered op runs where no fused kernel does (CUDA float64, ROCm,
head dims the memory-efficient kernel does not take): the op runs below
autograd, so its backward is the softmax gradient spelled out. It holds one
(batch, heads, Lq, Lk) score tensor at a time, as SDPA's math path does.
"""

import torch

from torchtitan_seq1f1b.attention.cpu_kernel import additive_mask
from torchtitan_seq1f1b.attention.cuda_mem_efficient import expand_heads, sum_groups
from torchtitan_seq1f1b.documents import SegmentDocuments

__all__ = ["math_backward", "math_forward"]


def _probabilities(q, k, lse, scale, documents):
    """(scores, lse): scores (B, H, Lq, Lk) bottom-right causal (and per document); lse
    (B, H, Lq) is computed if None. k has q's head count."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores + additive_mask(q.shape[1], k.shape[1], q, documents)
    if lse is None:
        lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


def _upcast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Half inputs computed in float32, as the fused kernels accumulate."""
    compute = torch.promote_types(tensors[0].dtype, torch.float32)
    return [t.to(compute) for t in tensors]


def math_forward(q, k, v, scale: float, documents: SegmentDocuments | None):
    """q (B, Lq, H, D), k, v (B, Lk, Hkv, D) -> out (B, Lq, H, D), lse (B, H, Lq)
    (float32 for half inputs)."""
    dtype, n_heads = q.dtype, q.shape[2]
    q, k, v = _upcast(q, k, v)
    probs, lse = _probabilities(q, expand_heads(k, n_heads), None, scale, documents)
    return torch.einsum("bhqk,bkhd->bqhd", probs, expand_heads(v, n_heads)).to(dtype), lse


def math_backward(grad, q, k, v, out, lse, scale: float, documents: SegmentDocuments | None):
    """(dq, dk, dv) of :func:`math_forward`; dk, dv per K/V head."""
    dtype, n_heads, n_kv = q.dtype, q.shape[2], k.shape[2]
    grad, q, k, v, out = _upcast(grad, q, k, v, out)
    k_full, v_full = expand_heads(k, n_heads), expand_heads(v, n_heads)
    probs, _ = _probabilities(q, k_full, lse, scale, documents)
    grad_v = torch.einsum("bhqk,bqhd->bkhd", probs, grad)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", grad, v_full)
    # Softmax backward: d(scores) = P * (dP - rowsum(dO * O)).
    row_dot = (grad * out).sum(-1).transpose(1, 2)[..., None]
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_q = torch.einsum("bhqk,bkhd->bqhd", grad_scores, k_full)
    grad_k = torch.einsum("bhqk,bqhd->bkhd", grad_scores, q)
    return grad_q.to(dtype), sum_groups(grad_k, n_kv).to(dtype), sum_groups(grad_v, n_kv).to(dtype)

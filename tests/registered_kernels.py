# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""CPU kernels for the GPU attention ops, registered under the ops' own names.

The stand-ins in :mod:`tests.kernel_fakes` replace a kernel's Python entry
point; these replace only its device kernel. A backend then runs its real
call path on CPU: the op names, their autograd formulas, and what op-level
checkpointing sees and saves. Each kernel counts its forward calls in
:data:`FORWARD_CALLS` and computes bottom-right causal attention naively.

flash-attn is not installed here: :func:`flash_attn_stand_in` gives a
backend whose entry points call ops registered under flash-attn's names.
"""

import collections
import math

import torch

from torchtitan_seq1f1b.attention import FlashAttnBackend

__all__ = ["FORWARD_CALLS", "flash_attn_stand_in", "register_cpu_kernels"]

FORWARD_CALLS: collections.Counter = collections.Counter()
_LIBRARIES: list = []  # registrations live as long as their Library objects


def _probabilities(q, k, scale):
    """One sequence: q (Lq, H, D), k (Lk, H, D) -> bottom-right causal (scores, probabilities) (H, Lq, Lk)."""
    q_len, k_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    hidden = torch.arange(k_len)[None, :] > torch.arange(q_len)[:, None] + (k_len - q_len)
    scores = scores.masked_fill(hidden, -math.inf)
    return scores, scores.softmax(-1)


def _heads(q, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), scale, groups


def _attend(q, k, v, scale):
    """One sequence: q (Lq, H, D), k, v (Lk, Hkv, D) -> (out (Lq, H, D), lse (H, Lq) float32)."""
    k, v, scale, _ = _heads(q, k, v, scale)
    scores, p = _probabilities(q, k, scale)
    return torch.einsum("hqk,khd->qhd", p, v), scores.logsumexp(-1).float()


def _attend_backward(grad, q, k, v, scale):
    """Gradients of :func:`_attend`'s output, written out: a kernel runs below autograd."""
    k_full, v_full, scale, groups = _heads(q, k, v, scale)
    _, p = _probabilities(q, k_full, scale)
    grad_v = torch.einsum("hqk,qhd->khd", p, grad)
    grad_p = torch.einsum("qhd,khd->hqk", grad, v_full)
    grad_s = p * (grad_p - (grad_p * p).sum(-1, keepdim=True)) * scale
    grad_q = torch.einsum("hqk,khd->qhd", grad_s, k_full)
    grad_k = torch.einsum("hqk,qhd->khd", grad_s, q)

    def per_kv_head(x):
        return x.unflatten(1, (k.shape[1], groups)).sum(2)

    return grad_q, per_kv_head(grad_k), per_kv_head(grad_v)


def _dense(q, k, v, scale):
    """(B, L, H, D) -> out (B, Lq, H, D), lse (B, H, Lq)."""
    outs, lses = zip(*(_attend(q[b], k[b], v[b], scale) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _dense_backward(grad, q, k, v, scale):
    rows = [_attend_backward(grad[b], q[b], k[b], v[b], scale) for b in range(q.shape[0])]
    return tuple(torch.stack(parts) for parts in zip(*rows))


def _sequences(cu_q, cu_k):
    return list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))


def _packed(q, k, v, cu_q, cu_k, scale):
    """Tokens (T, H, D) with cumulative lengths -> out (Tq, H, D), lse (H, Tq)."""
    outs, lses = [], []
    for qs, qe, ks, ke in _sequences(cu_q, cu_k):
        out, lse = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _packed_backward(grad, q, k, v, cu_q, cu_k, scale):
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _sequences(cu_q, cu_k):
        dq, dk, dv = _attend_backward(grad[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], scale)
        grad_q[qs:qe], grad_k[ks:ke], grad_v[ks:ke] = dq, dk, dv
    return grad_q, grad_k, grad_v


def _sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                *, scale=None):
    assert is_causal and dropout_p == 0.0
    FORWARD_CALLS["_scaled_dot_product_flash_attention"] += 1
    out, lse = _dense(*(x.transpose(1, 2) for x in (query, key, value)), scale)
    empty = query.new_empty(0, dtype=torch.int64)
    return (out.transpose(1, 2), lse, empty, empty, query.shape[2], key.shape[2],
            empty, empty, query.new_empty(0))


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                         *, scale=None):
    grads = _dense_backward(*(x.transpose(1, 2) for x in (grad_out, query, key, value)), scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _efficient(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *,
               scale=None, seqlen_k=None, window_size=None):
    assert custom_mask_type == 2 and bias is None and cu_seqlens_q is None
    FORWARD_CALLS["_efficient_attention_forward"] += 1
    out, lse = _dense(query, key, value, scale)
    seed = torch.zeros((), dtype=torch.int64)
    return out, lse, seed, seed, query.shape[1], key.shape[1]


def _efficient_backward(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed,
                        philox_offset, custom_mask_type, bias_requires_grad, *, scale=None,
                        num_splits_key=None, window_size=None, shared_storage_dqdkdv=False):
    return (*_dense_backward(grad_out, query, key, value, scale), None)


def _varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
            window_size=None, *unused):
    assert is_causal or list(window_size) == [-1, 0]
    FORWARD_CALLS["_varlen_attn"] += 1
    out, lse = _packed(query, key, value, cu_seq_q, cu_seq_k, scale)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                     is_causal, rng_state, scale=None, window_size=None, *unused):
    return _packed_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, scale)


def register_cpu_kernels() -> None:
    """Register the CPU kernels (once per process) for torch's flash, memory-efficient
    and varlen attention ops, forward and backward."""
    if _LIBRARIES:
        return
    aten = torch.library.Library("aten", "IMPL")
    for name, kernel in (
        ("_scaled_dot_product_flash_attention", _sdpa_flash),
        ("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward),
        ("_efficient_attention_forward", _efficient),
        ("_efficient_attention_backward", _efficient_backward),
    ):
        aten.impl(name, kernel, "CPU")
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _varlen, lib=aten)
    torch.library.register_kernel(
        "torch_attn::_varlen_attn_backward", "cpu", _varlen_backward, lib=aten
    )
    _LIBRARIES.append(aten)
    _define_flash_attn_ops()


def _define_flash_attn_ops() -> None:
    """Ops under flash-attn's names (dense and varlen forward, one backward)."""
    library = torch.library.Library("flash_attn", "DEF")
    library.define("_flash_attn_forward(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
    library.define(
        "_flash_attn_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, "
        "float scale) -> (Tensor, Tensor)"
    )
    library.define(
        "_flash_attn_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? cu_q, "
        "Tensor? cu_k, float scale) -> (Tensor, Tensor, Tensor)"
    )

    def dense(q, k, v, scale):
        FORWARD_CALLS["_flash_attn_forward"] += 1
        return _dense(q, k, v, scale)

    def varlen(q, k, v, cu_q, cu_k, scale):
        FORWARD_CALLS["_flash_attn_varlen_forward"] += 1
        return _packed(q, k, v, cu_q, cu_k, scale)

    def backward(grad, q, k, v, cu_q, cu_k, scale):
        if cu_q is None:
            return _dense_backward(grad, q, k, v, scale)
        return _packed_backward(grad, q, k, v, cu_q, cu_k, scale)

    library.impl("_flash_attn_forward", dense, "CPU")
    library.impl("_flash_attn_varlen_forward", varlen, "CPU")
    library.impl("_flash_attn_backward", backward, "CPU")
    _LIBRARIES.append(library)


class _FlashFunc(torch.autograd.Function):
    """flash-attn's entry points as it writes them: a Function around its forward op."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale):
        if cu_q is None:
            out, _ = torch.ops.flash_attn._flash_attn_forward(q, k, v, scale)
        else:
            out, _ = torch.ops.flash_attn._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, scale)
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        grads = torch.ops.flash_attn._flash_attn_backward(grad, q, k, v, cu_q, cu_k, ctx.scale)
        return (*grads, None, None, None)


def _scale(q, softmax_scale):
    return 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def flash_attn_stand_in() -> FlashAttnBackend:
    """The flash backend with flash-attn's entry points on the ops above."""

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, deterministic=False):
        assert causal
        return _FlashFunc.apply(q, k, v, None, None, _scale(q, softmax_scale))

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
               causal=False, deterministic=False):
        assert causal
        return _FlashFunc.apply(q, k, v, cu_q, cu_k, _scale(q, softmax_scale))

    return FlashAttnBackend(kernel=dense, varlen_kernel=varlen)

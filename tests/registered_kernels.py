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
import types

import torch

from torchtitan_seq1f1b.attention import FlashAttnBackend

__all__ = ["FORWARD_CALLS", "flash_attn_stand_in", "register_cpu_kernels"]

FORWARD_CALLS: collections.Counter = collections.Counter()
_LIBRARIES: list = []  # registrations live as long as their Library objects


def _probabilities(q, k, scale, left=-1):
    """One sequence: q (Lq, H, D), k (Lk, H, D) -> bottom-right causal (scores,
    probabilities) (H, Lq, Lk); ``left`` >= 0: each query sees at most that many earlier keys."""
    q_len, k_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    last = torch.arange(q_len)[:, None] + (k_len - q_len)
    hidden = torch.arange(k_len)[None, :] > last
    if left >= 0:
        hidden |= torch.arange(k_len)[None, :] < last - left
    scores = scores.masked_fill(hidden, -math.inf)
    return scores, scores.softmax(-1)


def _heads(q, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), scale, groups


def _attend(q, k, v, scale, left=-1):
    """One sequence: q (Lq, H, D), k, v (Lk, Hkv, D) -> (out (Lq, H, D), lse (H, Lq),
    float32 for half inputs)."""
    k, v, scale, _ = _heads(q, k, v, scale)
    scores, p = _probabilities(q, k, scale, left)
    lse = scores.logsumexp(-1).to(torch.promote_types(q.dtype, torch.float32))
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _attend_backward(grad, q, k, v, out, scale, left=-1):
    """Gradients of :func:`_attend`'s output, written out: a kernel runs below autograd.
    As the fused kernels do, it reads ``out`` (Lq, H, D) only for rowsum(grad * out)."""
    k_full, v_full, scale, groups = _heads(q, k, v, scale)
    _, p = _probabilities(q, k_full, scale, left)
    grad_v = torch.einsum("hqk,qhd->khd", p, grad)
    grad_p = torch.einsum("qhd,khd->hqk", grad, v_full)
    row_dot = (grad * out).sum(-1).transpose(0, 1)[..., None]
    grad_s = p * (grad_p - row_dot) * scale
    grad_q = torch.einsum("hqk,khd->qhd", grad_s, k_full)
    grad_k = torch.einsum("hqk,qhd->khd", grad_s, q)

    def per_kv_head(x):
        return x.unflatten(1, (k.shape[1], groups)).sum(2)

    return grad_q, per_kv_head(grad_k), per_kv_head(grad_v)


def _dense(q, k, v, scale):
    """(B, L, H, D) -> out (B, Lq, H, D), lse (B, H, Lq)."""
    outs, lses = zip(*(_attend(q[b], k[b], v[b], scale) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _saved_as_computed(found, expected) -> None:
    """A backward's output and logsumexp have the forward's layout, and its logsumexp
    is the forward's (its output may be rescaled: attention sinks).

    torch's shape inference runs backward on uninitialised buffers: those compare NaN for NaN.
    """
    for name, a, b in zip(("output", "logsumexp"), found, expected):
        assert a.shape == b.shape, f"saved {name} of shape {tuple(a.shape)}, not {tuple(b.shape)}"
    torch.testing.assert_close(
        found[1], expected[1], rtol=1e-6, atol=1e-6, equal_nan=True, msg="saved logsumexp"
    )


def _dense_backward(grad, q, k, v, out, lse, scale):
    _saved_as_computed((out, lse), _dense(q, k, v, scale))
    rows = [_attend_backward(grad[b], q[b], k[b], v[b], out[b], scale) for b in range(q.shape[0])]
    return tuple(torch.stack(parts) for parts in zip(*rows))


def _sequences(cu_q, cu_k):
    return list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))


def _packed(q, k, v, cu_q, cu_k, scale, left=-1):
    """Tokens (T, H, D) with cumulative lengths -> out (Tq, H, D), lse (H, Tq)."""
    outs, lses = [], []
    for qs, qe, ks, ke in _sequences(cu_q, cu_k):
        out, lse = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, left)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _packed_backward(grad, q, k, v, out, lse, cu_q, cu_k, scale, left=-1):
    _saved_as_computed((out, lse), _packed(q, k, v, cu_q, cu_k, scale, left))
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _sequences(cu_q, cu_k):
        dq, dk, dv = _attend_backward(
            grad[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], scale, left
        )
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
    grads = _dense_backward(
        *(x.transpose(1, 2) for x in (grad_out, query, key, value, out)), logsumexp, scale
    )
    return tuple(g.transpose(1, 2) for g in grads)


def _efficient(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *,
               scale=None, seqlen_k=None, window_size=None):
    assert custom_mask_type == 2 and bias is None and cu_seqlens_q is None
    FORWARD_CALLS["_efficient_attention_forward"] += 1
    out, lse = _dense(query, key, value, scale)
    # The CUDA kernel's rows: Lq rounded up to 32, the rest unwritten.
    rows = -(-query.shape[1] // 32) * 32
    lse = torch.nn.functional.pad(lse, (0, rows - query.shape[1]), value=float("nan"))
    seed = torch.zeros((), dtype=torch.int64)
    return out, lse, seed, seed, query.shape[1], key.shape[1]


def _efficient_backward(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed,
                        philox_offset, custom_mask_type, bias_requires_grad, *, scale=None,
                        num_splits_key=None, window_size=None, shared_storage_dqdkdv=False):
    assert logsumexp.shape[2] % 32 == 0, "logsumexp rows as the forward padded them"
    lse = logsumexp[..., : query.shape[1]]
    return (*_dense_backward(grad_out, query, key, value, out, lse, scale), None)


def _varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
            window_size=None, *unused):
    assert is_causal or list(window_size)[1] == 0
    FORWARD_CALLS["_varlen_attn"] += 1
    left = -1 if window_size is None else window_size[0]
    out, lse = _packed(query, key, value, cu_seq_q, cu_seq_k, scale, left)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                     is_causal, rng_state, scale=None, window_size=None, *unused):
    left = -1 if window_size is None else window_size[0]
    return _packed_backward(
        grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, scale, left
    )


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
    """Ops under flash-attn's names and signatures (>= 2.8: namespace ``flashattn``):
    dense and varlen forward and backward, the backwards writing caller-given grads."""
    library = torch.library.Library("flashattn", "DEF")
    fixed = "float softmax_scale, bool causal, int window_size_left, int window_size_right, float softcap, Tensor? alibi_slopes"
    library.define(
        f"_flash_attn_forward(Tensor q, Tensor k, Tensor v, float dropout_p, {fixed}, "
        "bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)"
    )
    library.define(
        "_flash_attn_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p, "
        "float softmax_scale, bool causal, int window_size_left=-1, int window_size_right=-1, "
        "float softcap=0.0, Tensor? alibi_slopes=None, bool return_softmax=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    )
    grads = "Tensor(a!)? dq, Tensor(b!)? dk, Tensor(c!)? dv"
    library.define(
        f"_flash_attn_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        f"Tensor softmax_lse, {grads}, float dropout_p, {fixed}, bool deterministic, "
        "Tensor? rng_state=None) -> Tensor"
    )
    library.define(
        f"_flash_attn_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        f"Tensor softmax_lse, {grads}, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        f"int max_seqlen_q, int max_seqlen_k, float dropout_p, {fixed}, bool deterministic, "
        "Tensor? rng_state=None) -> Tensor"
    )

    def check(dropout_p, causal, window_left, window_right, softcap, alibi_slopes):
        # A sliding window is (left, 0); -1 is unbounded.
        assert dropout_p == 0.0 and causal and window_right in (-1, 0)
        assert (window_left == -1) == (window_right == -1)
        assert softcap == 0.0 and alibi_slopes is None

    def dense(q, k, v, dropout_p, scale, causal, left, right, softcap, alibi, return_softmax):
        check(dropout_p, causal, left, right, softcap, alibi)
        assert left == -1, "windowed layouts go through the varlen kernels"
        FORWARD_CALLS["_flash_attn_forward"] += 1
        out, lse = _dense(q, k, v, scale)
        return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, left=-1, right=-1,
               softcap=0.0, alibi=None, return_softmax=False):
        check(dropout_p, causal, left, right, softcap, alibi)
        FORWARD_CALLS["_flash_attn_varlen_forward"] += 1
        out, lse = _packed(q, k, v, cu_q, cu_k, scale, left)
        return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)

    def write(found, dq, dk, dv):
        for grad, into in zip(found, (dq, dk, dv)):
            assert into.is_contiguous(), "flash-attn writes contiguous gradients"
            into.copy_(grad)
        return found[0].new_zeros(1)

    def backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, left, right,
                 softcap, alibi, deterministic, rng_state=None):
        check(dropout_p, causal, left, right, softcap, alibi)
        assert left == -1, "windowed layouts go through the varlen kernels"
        return write(_dense_backward(dout, q, k, v, out, lse, scale), dq, dk, dv)

    def varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
                        dropout_p, scale, causal, left, right, softcap, alibi, deterministic,
                        rng_state=None):
        check(dropout_p, causal, left, right, softcap, alibi)
        grads = _packed_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, left)
        return write(grads, dq, dk, dv)

    for name, kernel in (
        ("_flash_attn_forward", dense),
        ("_flash_attn_varlen_forward", varlen),
        ("_flash_attn_backward", backward),
        ("_flash_attn_varlen_backward", varlen_backward),
    ):
        library.impl(name, kernel, "CPU")
    _LIBRARIES.append(library)


def _flash_attn_interface() -> types.SimpleNamespace:
    """``flash_attn.flash_attn_interface`` as the flash backend calls it: the ops above."""
    ops = torch.ops.flashattn
    return types.SimpleNamespace(
        _wrapped_flash_attn_forward=ops._flash_attn_forward,
        _wrapped_flash_attn_backward=ops._flash_attn_backward,
        _wrapped_flash_attn_varlen_forward=ops._flash_attn_varlen_forward,
        _wrapped_flash_attn_varlen_backward=ops._flash_attn_varlen_backward,
    )


class _FlashFunc(torch.autograd.Function):
    """flash-attn's entry points as it writes them: a Function around its forward op."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window=(-1, -1)):
        if cu_q is None:
            out, lse, *_ = torch.ops.flashattn._flash_attn_forward(
                q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False
            )
        else:
            out, lse, *_ = torch.ops.flashattn._flash_attn_varlen_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, True, *window
            )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.scale, ctx.max_q, ctx.max_k, ctx.window = scale, max_q, max_k, window
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        grads = [torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v)]
        fixed = (0.0, ctx.scale, True, *ctx.window, 0.0, None, False)
        if cu_q is None:
            torch.ops.flashattn._flash_attn_backward(grad, q, k, v, out, lse, *grads, *fixed)
        else:
            torch.ops.flashattn._flash_attn_varlen_backward(
                grad, q, k, v, out, lse, *grads, cu_q, cu_k, ctx.max_q, ctx.max_k, *fixed
            )
        return (*grads, None, None, None, None, None, None)


def _scale(q, softmax_scale):
    return 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def flash_attn_stand_in() -> FlashAttnBackend:
    """The flash backend with flash-attn's entry points and interface on the ops above."""
    register_cpu_kernels()

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, deterministic=False):
        assert causal
        return _FlashFunc.apply(q, k, v, None, None, None, None, _scale(q, softmax_scale))

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
               causal=False, deterministic=False, window_size=(-1, -1)):
        assert causal
        return _FlashFunc.apply(
            q, k, v, cu_q, cu_k, max_q, max_k, _scale(q, softmax_scale), tuple(window_size)
        )

    return FlashAttnBackend(kernel=dense, varlen_kernel=varlen, interface=_flash_attn_interface())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""CPU stand-ins for the GPU attention kernels, written from their documented
contracts in plain torch, and a naive reference they answer with.

Each stand-in asserts the contract its kernel documents (layouts, head
counts, contiguity, flags), records what it was called with, and computes
bottom-right causal attention naively, so code that passes through a
stand-in both calls the kernel the way it must and gets exact answers.
"""

import functools
import inspect
import math

import torch
import torch.nn.attention.varlen

from torchtitan_seq1f1b.attention import (
    AttentionBackend,
    FlashAttnBackend,
    KernelTarget,
    TorchFlashBackend,
)
from torchtitan_seq1f1b.check.counters import HostTransferCounter
from torchtitan_seq1f1b.check.kernels import reference_attention as naive_attention
from torchtitan_seq1f1b.attention.packing import per_document
from torchtitan_seq1f1b.attention.torch_varlen import (
    lower_right_causal_attention_flash,
    varlen_attention,
)
from torchtitan_seq1f1b.attention.cuda_mem_efficient import lower_right_causal_attention_cuda
from torchtitan_seq1f1b.linear_attention import delta_rule_backward, delta_rule_forward

__all__ = [
    "FakeEfficientAttentionOps",
    "FakeFla",
    "FakeFlashAttnFunc",
    "FakeFlashAttnVarlenFunc",
    "FakeTorchFlashOps",
    "FakeTorchVarlenAttn",
    "StandIn",
    "cuda_exact_path",
    "naive_attention",
    "stand_in_backend",
]


def _on_device(method):
    """A stand-in's checks and arithmetic are what a kernel does on the device:
    no host transfer of the caller's is counted inside."""

    @functools.wraps(method)
    def inside(*args, **kwargs):
        with HostTransferCounter.ignored():
            return method(*args, **kwargs)

    return inside


def _naive_logsumexp(q, k, scale):
    """(B, Lq, H, D) x (B, Lk, H, D) -> (B, H, Lq), bottom-right causal."""
    q_len, k_len = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    masked = torch.arange(k_len)[None] > torch.arange(q_len)[:, None] + (k_len - q_len)
    return scores.masked_fill(masked, float("-inf")).logsumexp(-1)


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, Lq) -> (B, H, Lq rounded up to 32): the memory-efficient kernel's rows,
    the padding unwritten (NaN here, so reading it shows)."""
    rows = -(-lse.shape[2] // 32) * 32
    return torch.nn.functional.pad(lse, (0, rows - lse.shape[2]), value=float("nan"))


def _check_dense(q, k, v, seq_dim: int) -> None:
    """Shared contract of the dense kernels: 4-D, one batch, GQA-divisible
    heads, same dtype, last dim contiguous."""
    head_dim_of = [x.dim() == 4 and x.stride(-1) == 1 for x in (q, k, v)]
    assert all(head_dim_of), "4-D inputs with a contiguous last dim"
    heads_dim = 3 - seq_dim
    assert q.shape[0] == k.shape[0] == v.shape[0] and k.shape == v.shape
    assert q.shape[-1] == k.shape[-1]
    assert q.shape[heads_dim] % k.shape[heads_dim] == 0
    assert q.dtype == k.dtype == v.dtype
    assert k.shape[seq_dim] >= q.shape[seq_dim]


class _Recorder:
    def __init__(self):
        self.calls: list[dict] = []

    def record(self, q, k, v, seq_dim: int, **extra) -> None:
        self.calls.append(
            dict(
                q_len=q.shape[seq_dim],
                k_len=k.shape[seq_dim],
                k_storage=k.untyped_storage().data_ptr(),
                v_storage=v.untyped_storage().data_ptr(),
                **extra,
            )
        )


class FakeFlashAttnFunc(_Recorder):
    """``flash_attn.flash_attn_func`` (flash-attn 2): (B, L, H, D), any batch
    stride, causal bottom-right when Lq < Lk, GQA native."""

    @_on_device
    def __call__(
        self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False,
    ):
        assert causal is True, "Seq1F1B attention must pass causal=True"
        assert dropout_p == 0.0 and window_size == (-1, -1) and not return_attn_probs
        _check_dense(q, k, v, seq_dim=1)
        self.record(q, k, v, seq_dim=1, scale=softmax_scale, deterministic=deterministic)
        return naive_attention(q, k, v, softmax_scale)


def _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """Shared contract of the varlen kernels: packed 3-D (tokens, heads, head_dim)
    inputs with a contiguous last dim, int32 cumulative lengths on the inputs'
    device covering them, max lengths at least every sequence's."""
    assert all(x.dim() == 3 and x.stride(-1) == 1 for x in (q, k, v)), "packed 3-D inputs"
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0
    assert q.dtype == k.dtype == v.dtype
    for cu, packed in ((cu_q, q), (cu_k, k)):
        assert cu.dtype == torch.int32 and cu.device == packed.device and cu.dim() == 1
        assert int(cu[0]) == 0 and int(cu[-1]) == packed.shape[0], "cu_seqlens cover the input"
        assert bool((cu[1:] >= cu[:-1]).all())
    assert len(cu_q) == len(cu_k)
    q_lens, k_lens = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    assert max_q >= max(q_lens) and max_k >= max(k_lens)
    assert all(kl >= ql for ql, kl in zip(q_lens, k_lens)), "a sequence's keys end with its queries"
    return list(zip(q_lens, k_lens))


def _unwritten_gaps(k, v, sequences) -> None:
    """Key gradients of sequences without queries come back NaN: a kernel need
    not write them (FlashAttention 2 writes zeros), so callers must not read them."""
    first, gaps = 0, []
    for q_len, k_len in sequences:
        if q_len == 0:
            gaps += range(first, first + k_len)
        first += k_len
    if not gaps:
        return
    rows = torch.tensor(gaps)
    for x in (k, v):
        if x.requires_grad:
            x.register_hook(lambda grad: grad.index_fill(0, rows.to(grad.device), float("nan")))


def _naive_varlen(q, k, v, cu_q, cu_k, scale):
    """Bottom-right causal attention per sequence of the packed inputs."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        outs.append(naive_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale)[0])
    return torch.cat(outs)


class FakeFlashAttnVarlenFunc(_Recorder):
    """``flash_attn.flash_attn_varlen_func`` (flash-attn 2): packed (tokens, H, D),
    ``cu_seqlens`` int32, causal bottom-right per sequence, GQA native."""

    @_on_device
    def __call__(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):
        assert causal is True, "Seq1F1B attention must pass causal=True"
        assert dropout_p == 0.0 and window_size == (-1, -1) and not return_attn_probs
        sequences = _check_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
        _unwritten_gaps(k, v, sequences)
        self.record(
            q, k, v, seq_dim=0, scale=softmax_scale, sequences=sequences,
            deterministic=deterministic,
        )
        return _naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)


# The installed torch's varlen_attn keywords: the stand-in takes exactly these.
_VARLEN_OPTIONS = set(inspect.signature(torch.nn.attention.varlen.varlen_attn).parameters)


class FakeTorchVarlenAttn(_Recorder):
    """``torch.nn.attention.varlen.varlen_attn``: packed (tokens, H, D), int32
    ``cu_seq_q``/``cu_seq_k``; ``window_size=(-1, 0)`` is causal from the bottom
    right of each sequence; ``enable_gqa`` is required when head counts differ, on a
    torch whose ``varlen_attn`` takes it (2.12+), and refused on one that does not."""

    @_on_device
    def __call__(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
        scale=None, window_size=(-1, -1), seqused_k=None, block_table=None,
        num_splits=None, **options,
    ):
        assert window_size == (-1, 0), "causal attention is window_size=(-1, 0)"
        assert return_aux is None and seqused_k is None and block_table is None
        assert set(options) <= _VARLEN_OPTIONS & {"enable_gqa"}, f"varlen_attn takes no {options}"
        if "enable_gqa" in _VARLEN_OPTIONS:
            grouped = options.get("enable_gqa", False)
            assert grouped or query.shape[1] == key.shape[1], "enable_gqa for grouped K/V"
        # One tensor for both would make torch 2.15 pick cuDNN, which aligns top-left.
        assert cu_seq_q is not cu_seq_k, "cu_seq_q and cu_seq_k are distinct tensors"
        sequences = _check_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        _unwritten_gaps(key, value, sequences)
        self.record(query, key, value, seq_dim=0, scale=scale, sequences=sequences)
        return _naive_varlen(query, key, value, cu_seq_q, cu_seq_k, scale)


class FakeTorchFlashOps(_Recorder):
    """``torch.ops.aten._scaled_dot_product_flash_attention``: (B, H, L, D),
    ``is_causal`` bottom-right when Lq < Lk, GQA native, autograd built in."""

    @_on_device
    def _scaled_dot_product_flash_attention(
        self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
        *, scale=None,
    ):
        assert is_causal is True and dropout_p == 0.0 and not return_debug_mask
        _check_dense(query, key, value, seq_dim=2)
        self.record(query, key, value, seq_dim=2, scale=scale)
        out = naive_attention(*(x.transpose(1, 2) for x in (query, key, value)), scale)
        return (out.transpose(1, 2),)


class FakeEfficientAttentionOps(_Recorder):
    """``torch.ops.aten._efficient_attention_forward`` / ``_backward``:
    (B, L, H, D) with equal head counts, ``custom_mask_type`` 2 = causal from
    the bottom right; the caller owns autograd."""

    @_on_device
    def _efficient_attention_forward(
        self, query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *,
        scale=None, seqlen_k=None, window_size=None,
    ):
        assert bias is None and cu_seqlens_q is None and cu_seqlens_k is None
        assert max_seqlen_q is None and max_seqlen_k is None and dropout_p == 0.0
        assert custom_mask_type == 2, "bottom-right causal is custom_mask_type 2"
        _check_dense(query, key, value, seq_dim=1)
        assert query.shape[2] == key.shape[2], "equal head counts"
        self.record(query, key, value, seq_dim=1, scale=scale)
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        out = naive_attention(query, key, value, scale)
        lse = _padded_lse(_naive_logsumexp(query, key, scale)) if compute_log_sumexp else None
        seed = offset = torch.zeros((), dtype=torch.int64)
        return out, lse, seed, offset, query.shape[1], key.shape[1]

    @_on_device
    def _efficient_attention_backward(
        self, grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset,
        custom_mask_type, bias_requires_grad, *, scale=None, num_splits_key=None,
        window_size=None, shared_storage_dqdkdv=False,
    ):
        assert custom_mask_type == 2 and not bias_requires_grad and dropout_p == 0.0
        assert query.shape[2] == key.shape[2], "equal head counts"
        assert (max_seqlen_q, max_seqlen_k) == (query.shape[1], key.shape[1])
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (query, key, value)]
            recomputed = naive_attention(*leaves, scale)
            # torch's metadata inference runs backward on uninitialised buffers:
            # NaN in, NaN saved and recomputed alike.
            torch.testing.assert_close(recomputed.detach(), out, equal_nan=True, msg="saved output")
            assert logsumexp.shape[2] % 32 == 0, "logsumexp rows as the forward padded them"
            torch.testing.assert_close(
                _naive_logsumexp(query, key, scale), logsumexp[..., : query.shape[1]],
                equal_nan=True,
            )
            grads = torch.autograd.grad(recomputed, leaves, grad_out)
        return (*grads, None)


class StandIn(AttentionBackend):
    """A GPU backend run on CPU through stand-ins: its device checks are skipped."""

    def __init__(self, name: str, call):
        self.name, self._call = name, call

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        return []

    def __call__(self, q, k, v, scale, documents=None):
        return self._call(q, k, v, scale, documents)


def cuda_exact_path(kernel, q, k, v, scale, documents=None):
    """The CUDA exact path as SDPABackend takes it where the memory-efficient kernel runs."""
    if documents is None:
        return kernel(q, k, v, scale)
    return per_document(kernel, q, k, v, scale, documents)


def stand_in_backend(kind: str) -> tuple[AttentionBackend, _Recorder]:
    """A backend for ``kind`` ("flash", "varlen" or "cuda_exact") that runs the
    adapter code on CPU through the kernel's stand-ins: (backend, dense stand-in).
    The varlen stand-in (packed documents) is the backend's ``varlen_fake``."""
    if kind == "flash":
        fake, varlen = FakeFlashAttnFunc(), FakeFlashAttnVarlenFunc()
        backend = StandIn("flash", FlashAttnBackend(kernel=fake, varlen_kernel=varlen))
    elif kind == "varlen":
        fake, varlen = FakeTorchFlashOps(), FakeTorchVarlenAttn()
        kernel = functools.partial(lower_right_causal_attention_flash, ops=fake)
        varlen_kernel = functools.partial(varlen_attention, varlen_attn=varlen)
        backend = StandIn("varlen", TorchFlashBackend(kernel, varlen_kernel))
    elif kind == "cuda_exact":
        fake, varlen = FakeEfficientAttentionOps(), None
        kernel = functools.partial(lower_right_causal_attention_cuda, ops=fake)
        backend = StandIn("cuda_exact", functools.partial(cuda_exact_path, kernel))
    else:
        raise ValueError(f"no stand-in for {kind!r}")
    backend.varlen_fake = varlen
    return backend, fake


def _fla_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """(chunks, 2): (sequence, chunk within it) of every ``chunk_size`` chunk, as fla counts them."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pairs = [(n, i) for n, length in enumerate(lengths) for i in range(-(-length // chunk_size))]
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


class FakeFla:
    """fla 0.6's ``chunk_gated_delta_rule`` (its signature) and the backward
    :mod:`torchtitan_seq1f1b.linear_attention._fla` calls, computed sequence by
    sequence with the exact path in the inputs' dtype; ``calls`` records each
    call's cu_seqlens, initial states, final states, dht and dh0.

    Layouts as fla's: (B, T, H, K) or, with ``cu_seqlens`` (N + 1,) int64,
    one batch of N sequences back to back; states (N, HV, K, V).
    """

    def __init__(self):
        self.calls: list[dict] = []

    chunk_indices = staticmethod(_fla_chunk_indices)

    @staticmethod
    def _sequences(q, initial_state, cu_seqlens, chunk_indices):
        """(batch index, token slice) per sequence, after checking fla's varlen contract."""
        if cu_seqlens is None:
            assert chunk_indices is None
            return [(b, slice(None)) for b in range(q.shape[0])]
        assert q.shape[0] == 1, "fla's varlen takes one batch"
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1
        assert cu_seqlens.device == q.device
        bounds = cu_seqlens.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.shape[1], "cu_seqlens cover the tokens"
        assert all(b > a for a, b in zip(bounds, bounds[1:])), "no empty sequence"
        assert torch.equal(chunk_indices.cpu(), _fla_chunk_indices(cu_seqlens.cpu()))
        assert initial_state is None or initial_state.shape[0] == len(bounds) - 1
        return [(0, slice(a, b)) for a, b in zip(bounds, bounds[1:])]

    @_on_device
    def chunk_gated_delta_rule(
        self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
        chunk_indices=None, cp_context=None, **kwargs,
    ):
        assert use_qk_l2norm_in_kernel and output_final_state and scale is not None
        assert not (use_beta_sigmoid_in_kernel or state_v_first or kwargs or cp_context)
        assert q.shape == k.shape and v.shape[2] % q.shape[2] == 0
        outs, finals = [], []
        for n, (b, tokens) in enumerate(self._sequences(q, initial_state, cu_seqlens, chunk_indices)):
            h0 = None if initial_state is None else initial_state[n : n + 1]
            o, final = delta_rule_forward(
                *(x[b : b + 1, tokens] for x in (q, k, v, g, beta)), scale, h0
            )
            outs.append(o)
            finals.append(final)
        o = torch.cat(outs, dim=1 if cu_seqlens is not None else 0)
        final = torch.cat(finals)
        self.calls.append(dict(
            kind="forward", cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(),
            initial_state=initial_state, final_state=final,
        ))
        return o, final

    @_on_device
    def chunk_gated_delta_rule_backward(
        self, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens=None,
        chunk_indices=None,
    ):
        sequences = self._sequences(q, initial_state, cu_seqlens, chunk_indices)
        assert dht is None or dht.shape[0] == len(sequences)
        grads, dh0 = [[] for _ in range(5)], []
        for n, (b, tokens) in enumerate(sequences):
            h0 = None if initial_state is None else initial_state[n : n + 1]
            got = delta_rule_backward(
                do[b : b + 1, tokens], None if dht is None else dht[n : n + 1],
                *(x[b : b + 1, tokens] for x in (q, k, v, g, beta)), scale, h0,
            )
            for grad, part in zip(grads, (got.q, got.k, got.v, got.g, got.beta)):
                grad.append(part)
            dh0.append(got.initial_state)
        dim = 1 if cu_seqlens is not None else 0
        dh0 = None if initial_state is None else torch.cat(dh0)
        self.calls.append(dict(
            kind="backward", cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(),
            initial_state=initial_state, dht=dht, dh0=dh0,
        ))
        return (*(torch.cat(grad, dim=dim) for grad in grads), dh0)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Causal attention kernels for a segment attending to its prefix.

Every backend computes the same function: queries of a segment of ``Lq``
tokens attend to ``Lk >= Lq`` keys whose last ``Lq`` positions are the
segment itself, with the causal mask aligned bottom-right (query t sees keys
``<= Lk - Lq + t``). Layouts are sequence-major, as varlen kernels take them:

    q: (batch, Lq, n_heads, head_dim)
    k, v: (batch, Lk, n_kv_heads, head_dim), n_heads % n_kv_heads == 0
    returns (batch, Lq, n_heads, head_dim)

The varlen adapters build one (query, key) sequence pair per batch row
(``cu_seqlens``); packed documents would add pairs per document there.
"""

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchtitan_seq1f1b._torch_compat import lower_right_causal_attention_cpu

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "FlashVarlenBackend",
    "SDPABackend",
    "TorchVarlenBackend",
    "resolve_backend",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} K/V heads"
        )


class AttentionBackend:
    """Bottom-right causal attention of q against k/v (see module docstring)."""

    name: str

    def supports(self, q: torch.Tensor) -> bool:
        """Whether this backend can run on ``q``'s device and dtype."""
        raise NotImplementedError

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        raise NotImplementedError


class SDPABackend(AttentionBackend):
    """Exact PyTorch path (any device and dtype, float64 included)."""

    name = "sdpa"

    def supports(self, q: torch.Tensor) -> bool:
        return True

    def __call__(self, q, k, v, scale):
        _check_heads(q, k)
        q_len, k_len = q.shape[1], k.shape[1]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # SDPA's is_causal is top-left aligned when lengths differ: only safe
        # for q_len == k_len. Otherwise a lower-right mask gives the segment its
        # whole prefix. On CPU the mask is rebuilt in backward rather than
        # saved (it would cost as much memory as the K prefix). Elsewhere it is
        # a plain bool tensor, not torch's CausalBias: that tensor subclass
        # cannot be created under selective activation checkpointing's
        # dispatch mode.
        if q_len == k_len:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        elif q.device.type == "cpu":
            out = lower_right_causal_attention_cpu(q, k, v, scale)
        else:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(
                k_len - q_len
            )
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        return out.transpose(1, 2)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """(batch, L, heads, head_dim) -> (batch * L, heads, head_dim); free when batch == 1."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


def _cu_seqlens(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(
        0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device
    )


class _VarlenBackend(AttentionBackend):
    """Shared packing for kernels that take (total_tokens, heads, head_dim) inputs."""

    module: str
    function: str

    def __init__(self, kernel: Callable | None = None):
        self._kernel = kernel

    @property
    def kernel(self) -> Callable:
        if self._kernel is None:
            self._kernel = getattr(importlib.import_module(self.module), self.function)
        return self._kernel

    @classmethod
    def installed(cls) -> bool:
        try:
            return hasattr(importlib.import_module(cls.module), cls.function)
        except ImportError:
            return False

    def supports(self, q: torch.Tensor) -> bool:
        return q.is_cuda and q.dtype in _HALF_DTYPES

    def __call__(self, q, k, v, scale):
        _check_heads(q, k)
        batch, q_len, n_heads, head_dim = q.shape
        k_len = k.shape[1]
        out = self._call_kernel(
            _packed(q),
            _packed(k),
            _packed(v),
            _cu_seqlens(batch, q_len, q.device),
            _cu_seqlens(batch, k_len, q.device),
            q_len,
            k_len,
            scale,
        )
        return out.view(batch, q_len, n_heads, head_dim)

    def _call_kernel(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        raise NotImplementedError


class FlashVarlenBackend(_VarlenBackend):
    """FlashAttention 2 ``flash_attn_varlen_func`` (CUDA, fp16/bf16).

    flash-attn >= 2.1 aligns ``causal=True`` bottom-right when the query and
    key lengths differ, and runs GQA natively.
    """

    name = "flash"
    module = "flash_attn"
    function = "flash_attn_varlen_func"

    def _call_kernel(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return self.kernel(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True
        )


class TorchVarlenBackend(_VarlenBackend):
    """torch ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16).

    Causality is the window (-1, 0), which like flash-attn is aligned
    bottom-right.
    """

    name = "varlen"
    module = "torch.nn.attention.varlen"
    function = "varlen_attn"

    def _call_kernel(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return self.kernel(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            scale=scale,
            window_size=(-1, 0),
            enable_gqa=q.shape[1] != k.shape[1],
        )


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashVarlenBackend,
    "varlen": TorchVarlenBackend,
    "sdpa": SDPABackend,
}


class _AutoBackend(AttentionBackend):
    """The first backend, in ATTENTION_BACKENDS order, that runs on the input."""

    name = "auto"

    def __init__(self):
        self._backends = [SDPABackend()]
        for cls in (TorchVarlenBackend, FlashVarlenBackend):
            if cls.installed():
                self._backends.insert(0, cls())

    def supports(self, q: torch.Tensor) -> bool:
        return True

    def __call__(self, q, k, v, scale):
        backend = next(b for b in self._backends if b.supports(q))
        return backend(q, k, v, scale)


def resolve_backend(name: str) -> AttentionBackend:
    """Backend for an ``attention_backend`` option: "auto", "flash", "varlen" or "sdpa"."""
    if name == "auto":
        return _AutoBackend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend={name!r} is unknown; choose one of "
            f"{['auto', *ATTENTION_BACKENDS]}"
        )
    cls = ATTENTION_BACKENDS[name]
    if issubclass(cls, _VarlenBackend) and not cls.installed():
        hint = (
            "pip install 'torchtitan-seq1f1b[flash]'"
            if name == "flash"
            else "use a torch build that ships torch.nn.attention.varlen"
        )
        raise ValueError(
            f"attention_backend={name!r} needs {cls.module}.{cls.function}, which "
            f"is not installed ({hint}), or use attention_backend='auto'"
        )
    return cls()

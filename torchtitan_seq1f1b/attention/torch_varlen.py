# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch's CUDA flash attention kernel (FlashAttention 2): the ``varlen`` backend.

Without documents it is called dense; with packed documents all rows go
through one ``torch.nn.attention.varlen.varlen_attn`` call with per-document
``cu_seq_q``/``cu_seq_k`` and ``window_size=(-1, 0)``, causal from the bottom
right of every document (``(window_left, 0)`` for a sliding window, which is
always laid out as documents).

This is the kernel behind ``torch.nn.attention.varlen.varlen_attn``. Called
dense, on (batch, heads, length, head_dim) tensors whose last dim is
contiguous, it takes a K/V prefix that is a batch-strided slice of the
per-microbatch buffers as it is: no packing copy at any microbatch size.
With ``is_causal`` and fewer queries than keys the mask is aligned
bottom-right (FlashAttention 2 semantics, on which torch's own ``CausalBias``
lower-right dispatch relies). GQA is native. The op has an autograd formula
that saves q, k, v, the output and the logsumexp.
"""

import inspect
from collections.abc import Callable

import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn as torch_varlen_attn

from torchtitan_seq1f1b._torch_compat.attention_ops import varlen_attn_backward
from torchtitan_seq1f1b.attention.backend import (
    AttentionBackend,
    check_heads,
    flash_kernel_requirements,
    KernelTarget,
)
from torchtitan_seq1f1b.attention.newer_flash import activate_newer_flash
from torchtitan_seq1f1b.attention.packing import (
    packed_varlen,
    packed_varlen_backward,
    packed_varlen_forward,
)
from torchtitan_seq1f1b.documents import SegmentDocuments

__all__ = [
    "TorchFlashBackend",
    "flash_backward",
    "flash_forward",
    "lower_right_causal_attention_flash",
    "varlen_attention",
]


def lower_right_causal_attention_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, ops=torch.ops.aten
) -> torch.Tensor:
    """q: (batch, q_len, heads, head_dim); k, v: (batch, k_len, kv_heads,
    head_dim). Returns (batch, q_len, heads, head_dim). ``ops`` lets tests
    stand in for the CUDA-only op on CPU."""
    out = ops._scaled_dot_product_flash_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,  # dropout_p
        True,  # is_causal: bottom-right when q_len < k_len
        False,  # return_debug_mask
        scale=scale,
    )[0]
    return out.transpose(1, 2)


def flash_forward(q, k, v, scale: float, ops=torch.ops.aten):
    """The dense kernel below autograd: out (batch, q_len, heads, head_dim), logsumexp
    (batch, heads, q_len) float32."""
    out, logsumexp, *_ = ops._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False, scale=scale
    )
    return out.transpose(1, 2), logsumexp


def flash_backward(grad, q, k, v, out, logsumexp, scale: float, ops=torch.ops.aten):
    """(dq, dk, dv) of :func:`flash_forward`, in its layouts."""
    # Without dropout the kernel reads no random state; dense calls have no cu_seq.
    no_dropout = torch.zeros((), dtype=torch.int64)
    grads = ops._scaled_dot_product_flash_attention_backward(
        *(x.transpose(1, 2) for x in (grad, q, k, v, out)), logsumexp, None, None,
        q.shape[1], k.shape[1], 0.0, True, no_dropout, no_dropout, scale=scale,
    )
    return tuple(g.transpose(1, 2) for g in grads)


def _window(documents: SegmentDocuments) -> tuple[int, int]:
    """``varlen_attn``'s causal window_size: (-1, 0), or (left, 0) for a sliding window."""
    return (-1 if documents.window_left is None else documents.window_left, 0)


# torch 2.11's varlen_attn has no enable_gqa: its flash kernel takes grouped K/V as they are.
_TAKES_ENABLE_GQA = "enable_gqa" in inspect.signature(torch_varlen_attn).parameters


def _varlen_options(q: torch.Tensor, k: torch.Tensor, scale: float | None, window) -> dict:
    options = dict(scale=scale, window_size=window)
    if _TAKES_ENABLE_GQA:
        options["enable_gqa"] = q.shape[1] != k.shape[1]
    return options


def varlen_attention(
    q, k, v, cu_q, cu_k, max_q, max_k, scale, window=(-1, 0),
    varlen_attn: Callable = torch_varlen_attn,
) -> torch.Tensor:
    """One row's documents through ``varlen_attn``: q (Lq, heads, head_dim), k, v
    (keys, kv_heads, head_dim). ``varlen_attn`` lets tests stand in for it on CPU."""
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **_varlen_options(q, k, scale, window))


def _varlen_forward(scale: float, window):
    def forward(q, k, v, cu_q, cu_k, max_q, max_k):
        return torch_varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
            **_varlen_options(q, k, scale, window),
        )

    return forward


def _varlen_backward(scale: float, window):
    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
        return varlen_attn_backward(
            grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window
        )

    return backward


class TorchFlashBackend(AttentionBackend):
    """torch's own FlashAttention 2 kernel: dense, or ``varlen_attn`` with documents.

    On sm90/sm100 with FlashAttention-4 (or -3) installed, torch's flash ops
    are routed to it first (:mod:`~torchtitan_seq1f1b.attention.newer_flash`).
    """

    name = "varlen"

    def __init__(
        self,
        kernel: Callable = lower_right_causal_attention_flash,
        varlen_kernel: Callable = varlen_attention,
    ):
        self.kernel = kernel
        self.varlen_kernel = varlen_kernel
        self._activated: set[torch.device] = set()

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = flash_kernel_requirements(target)
        capability = target.capability
        # torch's own gate: its flash backward lacks head_dim > 192 on these.
        small_smem = capability is not None and (
            (8, 6) <= capability <= (8, 9) or capability in ((12, 0), (12, 1))
        )
        if small_smem and target.head_dim > 192:
            unmet.append("head_dim <= 192 on sm86-89 and sm120/121 (torch's flash backward)")
        return unmet

    def _activate(self, q: torch.Tensor) -> None:
        if q.is_cuda and q.device not in self._activated:
            activate_newer_flash(KernelTarget.of(q))
            self._activated.add(q.device)

    def runs_as_op(self) -> bool:
        return True

    def forward(self, q, k, v, scale, documents):
        self._activate(q)
        if documents is None:
            out, lse = flash_forward(q, k, v, scale)
        else:
            forward = _varlen_forward(scale, _window(documents))
            out, lse = packed_varlen_forward(forward, q, k, v, documents)
        return out.contiguous(), lse.contiguous()

    def backward(self, grad, q, k, v, out, lse, scale, documents):
        if documents is None:
            return flash_backward(grad, q, k, v, out, lse, scale)
        backward = _varlen_backward(scale, _window(documents))
        return packed_varlen_backward(backward, grad, q, k, v, out, lse, documents)

    def __call__(self, q, k, v, scale, documents=None):
        check_heads(q, k)
        self._activate(q)
        if documents is None:
            return self.kernel(q, k, v, scale)

        def varlen(q_row, k_row, v_row, cu_q, cu_k, max_q, max_k):
            return self.varlen_kernel(
                q_row, k_row, v_row, cu_q, cu_k, max_q, max_k, scale, _window(documents)
            )

        return packed_varlen(varlen, q, k, v, documents)

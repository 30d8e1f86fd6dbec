# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""FlashAttention 2 (the ``flash-attn`` package, the ``flash`` extra): dense and varlen."""

import importlib
from collections.abc import Callable

import torch

from torchtitan_seq1f1b.attention.backend import (
    AttentionBackend,
    check_heads,
    flash_kernel_requirements,
    KernelTarget,
)
from torchtitan_seq1f1b.attention.packing import (
    packed_varlen,
    packed_varlen_backward,
    packed_varlen_forward,
)
from torchtitan_seq1f1b.documents import SegmentDocuments

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 2's ``flash_attn_func`` (the ``flash`` extra).

    flash-attn >= 2.1 aligns ``causal=True`` bottom-right when the query and
    key lengths differ, runs GQA natively and takes batch-strided inputs, so
    the prefix views go in as they are. With packed documents all rows go
    through one ``flash_attn_varlen_func`` call with per-document
    ``cu_seqlens`` (its causal mask is bottom-right per document too), as do
    sliding windows, with ``window_size=(window_left, 0)``.

    As the registered op it calls the forward and backward ops behind those
    entry points (``flash_attn.flash_attn_interface``, flash-attn >= 2.7).
    ``kernel``, ``varlen_kernel`` and ``interface`` let tests stand in for them.
    """

    name = "flash"
    module, function, varlen_function = "flash_attn", "flash_attn_func", "flash_attn_varlen_func"
    interface_module = "flash_attn.flash_attn_interface"
    # The entry points' forward and backward ops (flash-attn >= 2.7).
    interface_ops = (
        "_wrapped_flash_attn_forward",
        "_wrapped_flash_attn_backward",
        "_wrapped_flash_attn_varlen_forward",
        "_wrapped_flash_attn_varlen_backward",
    )

    def __init__(
        self,
        kernel: Callable | None = None,
        varlen_kernel: Callable | None = None,
        interface=None,
    ):
        self._kernel = kernel
        self._varlen_kernel = varlen_kernel
        self._interface = interface

    @property
    def kernel(self) -> Callable:
        if self._kernel is None:
            self._kernel = getattr(importlib.import_module(self.module), self.function)
        return self._kernel

    @property
    def varlen_kernel(self) -> Callable:
        if self._varlen_kernel is None:
            self._varlen_kernel = getattr(
                importlib.import_module(self.module), self.varlen_function
            )
        return self._varlen_kernel

    @property
    def interface(self):
        if self._interface is None:
            self._interface = importlib.import_module(self.interface_module)
        return self._interface

    @classmethod
    def installed(cls) -> bool:
        """Whether flash-attn >= 2.7 is installed: entry points and their ops."""
        try:
            entry_points = importlib.import_module(cls.module)
            interface = importlib.import_module(cls.interface_module)
        except ImportError:
            return False
        return hasattr(entry_points, cls.function) and all(
            hasattr(interface, op) for op in cls.interface_ops
        )

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = flash_kernel_requirements(target)
        if not unmet and self._kernel is None and not self.installed():
            unmet.append("flash-attn >= 2.7 installed (pip install 'torchtitan-seq1f1b[flash]')")
        return unmet

    def runs_as_op(self) -> bool:
        return True

    def forward(self, q, k, v, scale, documents):
        if documents is None:
            out, lse, *_ = self.interface._wrapped_flash_attn_forward(
                q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False
            )
        else:

            def varlen(q_tokens, k_tokens, v_tokens, cu_q, cu_k, max_q, max_k):
                return self.interface._wrapped_flash_attn_varlen_forward(
                    q_tokens, k_tokens, v_tokens, cu_q, cu_k, max_q, max_k, 0.0, scale, True,
                    *_window(documents),
                )[:2]

            out, lse = packed_varlen_forward(varlen, q, k, v, documents)
        return out.contiguous(), lse.contiguous()

    def backward(self, grad, q, k, v, out, lse, scale, documents):
        # The documents' window, no softcap, no ALiBi, no dropout (so no random state).
        fixed = (*_window(documents), 0.0, None, torch.are_deterministic_algorithms_enabled(), None)
        if documents is None:
            grads = _new_grads(q, k, v)
            self.interface._wrapped_flash_attn_backward(
                grad, q, k, v, out, lse, *grads, 0.0, scale, True, *fixed
            )
            return grads

        def varlen(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
            grads = _new_grads(q, k, v)
            self.interface._wrapped_flash_attn_varlen_backward(
                grad, q, k, v, out, lse, *grads, cu_q, cu_k, max_q, max_k, 0.0, scale, True,
                *fixed,
            )
            return grads

        return packed_varlen_backward(varlen, grad, q, k, v, out, lse, documents)

    def __call__(self, q, k, v, scale, documents=None):
        check_heads(q, k)
        # flash-attn's backward ignores torch's switch unless told.
        deterministic = torch.are_deterministic_algorithms_enabled()
        if documents is None:
            return self.kernel(
                q, k, v, dropout_p=0.0, softmax_scale=scale, causal=True,
                deterministic=deterministic,
            )

        def varlen(q_row, k_row, v_row, cu_q, cu_k, max_q, max_k):
            return self.varlen_kernel(
                q_row, k_row, v_row, cu_q, cu_k, max_q, max_k,
                dropout_p=0.0, softmax_scale=scale, causal=True, deterministic=deterministic,
                window_size=_window(documents),
            )

        return packed_varlen(varlen, q, k, v, documents)


def _window(documents: SegmentDocuments | None) -> tuple[int, int]:
    """flash-attn's (window_size_left, window_size_right): -1 is unbounded."""
    if documents is None or documents.window_left is None:
        return -1, -1
    return documents.window_left, 0


def _new_grads(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous gradients for the kernel to write: k and v may be strided views."""
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))

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
    packed_varlen,
)

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 2's ``flash_attn_func`` (the ``flash`` extra).

    flash-attn >= 2.1 aligns ``causal=True`` bottom-right when the query and
    key lengths differ, runs GQA natively and takes batch-strided inputs, so
    the prefix views go in as they are. With packed documents all rows go
    through one ``flash_attn_varlen_func`` call with per-document
    ``cu_seqlens`` (its causal mask is bottom-right per document too).
    """

    name = "flash"
    module, function, varlen_function = "flash_attn", "flash_attn_func", "flash_attn_varlen_func"

    def __init__(self, kernel: Callable | None = None, varlen_kernel: Callable | None = None):
        self._kernel = kernel
        self._varlen_kernel = varlen_kernel

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

    @classmethod
    def installed(cls) -> bool:
        try:
            return hasattr(importlib.import_module(cls.module), cls.function)
        except ImportError:
            return False

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = flash_kernel_requirements(target)
        if not unmet and self._kernel is None and not self.installed():
            unmet.append("flash-attn 2 installed (pip install 'torchtitan-seq1f1b[flash]')")
        return unmet

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
            )

        return packed_varlen(varlen, q, k, v, documents)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""FlashAttention 2 (the ``flash-attn`` package, the ``flash`` extra)."""

import importlib
from collections.abc import Callable

from torchtitan_seq1f1b.attention.backend import (
    AttentionBackend,
    check_heads,
    flash_kernel_requirements,
    KernelTarget,
)

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 2's ``flash_attn_func`` (the ``flash`` extra).

    flash-attn >= 2.1 aligns ``causal=True`` bottom-right when the query and
    key lengths differ, runs GQA natively and takes batch-strided inputs, so
    the prefix views go in as they are.
    """

    name = "flash"
    module, function = "flash_attn", "flash_attn_func"

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

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = flash_kernel_requirements(target)
        if not unmet and self._kernel is None and not self.installed():
            unmet.append("flash-attn 2 installed (pip install 'torchtitan-seq1f1b[flash]')")
        return unmet

    def __call__(self, q, k, v, scale):
        check_heads(q, k)
        return self.kernel(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=True)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The exact attention path: any device and dtype, float64 included."""

import torch
import torch.nn.functional as F

from torchtitan_seq1f1b.attention.backend import AttentionBackend, check_heads, KernelTarget
from torchtitan_seq1f1b.attention.cpu_kernel import (
    cpu_flash_backward,
    cpu_flash_forward,
    lower_right_causal_attention_cpu,
)
from torchtitan_seq1f1b.attention.cuda_mem_efficient import (
    lower_right_causal_attention_cuda,
    mem_efficient_backward,
    mem_efficient_forward,
    mem_efficient_requirements,
)
from torchtitan_seq1f1b.attention.math_kernel import math_backward, math_forward
from torchtitan_seq1f1b.documents import SegmentDocuments
from torchtitan_seq1f1b.attention.packing import (
    per_document,
    per_document_backward,
    per_document_forward,
)

__all__ = ["SDPABackend"]


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in tensors]


class SDPABackend(AttentionBackend):
    """The exact path: any device and dtype, float64 included.

    CPU: torch's CPU flash kernel with the mask rebuilt in backward. CUDA:
    the memory-efficient kernel with its built-in bottom-right mask where it
    runs (not float64), once per document with packed documents, else SDPA
    with a dense bool mask. Equal lengths without documents (the first
    segment, unsplit training) take SDPA's own causal path.

    As the registered op (:meth:`forward`, :meth:`backward`) it runs the same
    CPU and memory-efficient kernels, and plain masked softmax
    (:mod:`~torchtitan_seq1f1b.attention.math_kernel`) where SDPA's dense mask would.
    """

    name = "sdpa"

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        return []

    def runs_as_op(self) -> bool:
        return True

    def kernel(self, q: torch.Tensor, documents: SegmentDocuments | None = None) -> str:
        """Which kernel :meth:`forward` and :meth:`backward` run on ``q``: "cpu_flash",
        "mem_efficient" (once per document with packed documents) or "math" (also for
        a sliding window, which the memory-efficient kernel's causal mask lacks)."""
        kernel = self.device_kernel(q)
        if kernel == "mem_efficient" and documents is not None and documents.window_left is not None:
            return "math"
        return kernel

    def device_kernel(self, q: torch.Tensor) -> str:
        """The kernel for ``q``'s device and dtype, sliding windows aside."""
        if q.device.type == "cpu":
            return "cpu_flash"
        if not mem_efficient_requirements(KernelTarget.of(q)):
            return "mem_efficient"
        return "math"

    def forward(self, q, k, v, scale, documents):
        kernel = self.kernel(q, documents)
        if kernel == "cpu_flash":
            out, lse = cpu_flash_forward(*_heads_first(q, k, v), scale, documents)
            out = out.transpose(1, 2)
        elif kernel == "math":
            out, lse = math_forward(q, k, v, scale, documents)
        elif documents is None:
            out, lse = mem_efficient_forward(q, k, v, scale)
        else:
            out, lse = per_document_forward(mem_efficient_forward, q, k, v, scale, documents)
        return out.contiguous(), lse.contiguous()

    def backward(self, grad, q, k, v, out, lse, scale, documents):
        kernel = self.kernel(q, documents)
        if kernel == "cpu_flash":
            grads = cpu_flash_backward(*_heads_first(grad, q, k, v, out), lse, scale, documents)
            return tuple(g.transpose(1, 2) for g in grads)
        if kernel == "math":
            return math_backward(grad, q, k, v, out, lse, scale, documents)
        if documents is None:
            return mem_efficient_backward(grad, q, k, v, out, lse, scale)
        return per_document_backward(
            mem_efficient_backward, grad, q, k, v, out, lse, scale, documents
        )

    def __call__(self, q, k, v, scale, documents=None):
        check_heads(q, k)
        q_len, k_len = q.shape[1], k.shape[1]
        if self.kernel(q, documents) == "mem_efficient":
            if documents is not None:
                return per_document(lower_right_causal_attention_cuda, q, k, v, scale, documents)
            return lower_right_causal_attention_cuda(q, k, v, scale)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        # SDPA's is_causal is top-left aligned when lengths differ: only safe
        # for q_len == k_len.
        if q_len == k_len and documents is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif q.device.type == "cpu":
            out = lower_right_causal_attention_cpu(q, k, v, scale, documents)
        else:
            # A plain bool tensor, not torch's CausalBias: that tensor subclass
            # cannot be created under selective activation checkpointing.
            if documents is None:
                mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(
                    k_len - q_len
                )
            else:
                mask = documents.key_mask()
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        return out.transpose(1, 2)

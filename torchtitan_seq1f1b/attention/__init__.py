# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware causal attention and its kernels.

- :mod:`.segment_aware`: the module that replaces a model's inner attention
  and attends a segment to the K/V of its microbatch's earlier segments.
- :mod:`.backend`: the function every kernel computes and where it can run;
  :mod:`.choice`: what ``attention_backend`` selects ("auto" and forced).
- one module per kernel: :mod:`.exact` (any device and dtype) with its
  :mod:`.cpu_kernel`, :mod:`.cuda_mem_efficient` and :mod:`.math_kernel`
  paths, :mod:`.flash_attn` (FlashAttention 2), :mod:`.torch_varlen` (torch's
  flash kernel); :mod:`.packing` runs them on packed documents;
- :mod:`.segment_op`: the registered op a backend runs as, which torch.compile
  sees as one opaque call per layer;
- :mod:`.saved_ops`: their forward ops, which op-level checkpointing saves;
- :mod:`.binding`: the handle through which a segment-aware layer (softmax or
  linear attention) reaches its stage's K/V store, and :func:`bind_attention`,
  which binds every such layer.
"""

from torchtitan_seq1f1b.attention.backend import AttentionBackend, KernelTarget
from torchtitan_seq1f1b.attention.binding import bind_attention, SegmentAwareLayer
from torchtitan_seq1f1b.attention.choice import (
    ATTENTION_BACKENDS,
    check_backend,
    raise_if_unmet,
    resolve_backend,
)
from torchtitan_seq1f1b.attention.exact import SDPABackend
from torchtitan_seq1f1b.attention.flash_attn import FlashAttnBackend
from torchtitan_seq1f1b.attention.saved_ops import attention_forward_ops
from torchtitan_seq1f1b.attention.segment_aware import (
    bind_documents,
    SegmentAwareAttention,
    wrap_attention,
)
from torchtitan_seq1f1b.attention.torch_varlen import TorchFlashBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "FlashAttnBackend",
    "KernelTarget",
    "SDPABackend",
    "SegmentAwareAttention",
    "SegmentAwareLayer",
    "TorchFlashBackend",
    "attention_forward_ops",
    "bind_attention",
    "bind_documents",
    "check_backend",
    "raise_if_unmet",
    "resolve_backend",
    "wrap_attention",
]

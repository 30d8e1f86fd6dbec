# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware causal attention.

``SegmentAwareAttention`` replaces a model's inner attention op (the part that
takes q, k, v after RoPE and the head split). Inside a Seq1F1B unit it lets the
running segment attend to the K/V of all earlier segments of its microbatch;
anywhere else it is plain causal attention over the sequence it is given, so
the same model also trains unsplit. A schedule binds each stage's attention
layers to that stage's :class:`KVStore` (:func:`bind_attention`), which says
which unit is running.
"""

from collections.abc import Callable

import torch
import torch.nn as nn

from torchtitan_seq1f1b.attention.backend import AttentionBackend, KernelTarget
from torchtitan_seq1f1b.attention.choice import raise_if_unmet, resolve_backend
from torchtitan_seq1f1b.kv_store import KVStore

__all__ = ["SegmentAwareAttention", "bind_attention", "wrap_attention"]


class SegmentAwareAttention(nn.Module):
    """Causal attention that spans segments of a Seq1F1B microbatch.

    Args:
        backend: "auto" (flash-attn varlen, then torch varlen, on CUDA with
            fp16/bf16; exact SDPA otherwise), "flash", "varlen", "sdpa", or an
            ``AttentionBackend`` instance.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim).
    """

    def __init__(self, backend: str | AttentionBackend = "auto", scale: float | None = None):
        super().__init__()
        self.backend = resolve_backend(backend) if isinstance(backend, str) else backend
        self.scale = scale
        self.kv_store: KVStore | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """
        Args:
            q: (batch, n_heads, seq_len, head_dim), RoPE applied at global positions.
            k, v: (batch, n_kv_heads, seq_len, head_dim).
            enable_gqa: accepted for drop-in compatibility with torchtitan's
                attention wrappers; GQA follows from the head counts.

        Returns:
            (batch, n_heads, seq_len, head_dim)
        """
        raise_if_unmet(self.backend, KernelTarget.of(q))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        store = self.kv_store
        if store is not None and store.running is not None:
            k, v = store.attach(self, k, v)
        return self.backend(q, k, v, self.scale).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"backend={self.backend.name}"


def bind_attention(module: nn.Module, store: KVStore | None) -> int:
    """Point every :class:`SegmentAwareAttention` inside ``module`` at ``store``.

    Returns how many layers were bound. A schedule binds each stage's layers
    to the stage's store; ``None`` unbinds them (plain causal attention).
    """
    layers = [m for m in module.modules() if isinstance(m, SegmentAwareAttention)]
    for layer in layers:
        layer.kv_store = store
    return len(layers)


def wrap_attention(
    model: nn.Module,
    is_attention: Callable[[str, nn.Module], bool],
    backend: str | AttentionBackend = "auto",
) -> int:
    """Replace every submodule selected by ``is_attention(name, module)`` in place.

    Returns the number of modules replaced; each replacement shares nothing with
    the others, so each keeps its own K/V per microbatch.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if name and is_attention(name, module)
    ]
    for name, _ in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, SegmentAwareAttention(backend))
    return len(targets)

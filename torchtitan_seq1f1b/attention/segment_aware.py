# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware causal attention.

``SegmentAwareAttention`` replaces a model's inner attention op (the part that
takes q, k, v after RoPE and the head split). Inside a Seq1F1B unit it lets the
running segment attend to the K/V of all earlier segments of its microbatch
(with packed documents: of its own documents); anywhere else it is plain
causal attention over the sequence it is given, so the same model also trains
unsplit. With ``window_left`` it is sliding-window attention, reading and
keeping only the keys inside the window. A schedule binds each stage's
attention layers to that stage's :class:`KVStore` (:func:`bind_attention`),
which says which unit is running; :func:`bind_documents` gives an unsplit
model packed documents.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention.backend import AttentionBackend, KernelTarget
from torchtitan_seq1f1b.attention.binding import bind_attention, SegmentAwareLayer
from torchtitan_seq1f1b.attention.choice import raise_if_unmet, resolve_backend
from torchtitan_seq1f1b.attention.segment_op import segment_attention
from torchtitan_seq1f1b.documents import check_document_ids, MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["SegmentAwareAttention", "bind_documents", "wrap_attention"]


class SegmentAwareAttention(SegmentAwareLayer):
    """Causal attention that spans segments of a Seq1F1B microbatch.

    Args:
        backend: "auto" (flash-attn varlen, then torch varlen, on CUDA with
            fp16/bf16; exact SDPA otherwise), "flash", "varlen", "sdpa", or an
            ``AttentionBackend`` instance.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim).
        window_left: sliding-window attention: each query sees itself and at
            most this many keys before it (flash-attn's ``window_size[0]``);
            ``None``: every earlier key of its document.
    """

    def __init__(
        self,
        backend: str | AttentionBackend = "auto",
        scale: float | None = None,
        window_left: int | None = None,
    ):
        super().__init__()
        if window_left is not None and window_left < 0:
            raise ValueError(f"window_left must be >= 0 or None, got {window_left}")
        self.backend = resolve_backend(backend) if isinstance(backend, str) else backend
        self.scale = scale
        self.window_left = window_left

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
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return self.attend(q, k, v).transpose(1, 2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention itself, in the kernels' layout.

        Args:
            q: (batch, seq_len, n_heads, head_dim), RoPE applied.
            k: (batch, seq_len, n_kv_heads, head_dim).
            v: (batch, seq_len, n_kv_heads, v_head_dim); MLA's differs from head_dim.
            scale: softmax scale for this call; ``None`` means the module's.
            sinks: (n_heads,) attention-sink logits (gpt_oss), or None: each
                output is rescaled by ``sigmoid(logsumexp - sinks[h])``.

        Returns:
            (batch, seq_len, n_heads, v_head_dim)
        """
        scale = self.scale if scale is None else scale
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        v_head_dim = v.shape[-1]
        if v_head_dim != q.shape[-1]:
            # The kernels take one head dim. Zero columns add nothing to a score,
            # and V's zero columns give output columns that are cut off.
            width = max(v_head_dim, q.shape[-1])
            q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
            return self._attend_equal_head_dims(q, k, v, scale, sinks)[..., :v_head_dim]
        return self._attend_equal_head_dims(q, k, v, scale, sinks)

    def _attend_equal_head_dims(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks
    ) -> torch.Tensor:
        # Compiled blocks call the op, so that dynamo traces nothing of the store. Eager
        # attention attends to views of the K/V buffers, which autograd then saves: the
        # op saves the segment's own k and v besides. Sinks need the op's backward,
        # sliding windows its store of window tails.
        if torch.compiler.is_compiling() and self.backend.runs_as_op():
            # Decided before reading the store: a guard on it would recompile every block.
            return segment_attention(q, k, v, self.handle, scale, sinks)[0]
        running = self.kv_store.running if self.kv_store is not None else None
        context_parallel = running is not None and running.context is not None
        needs_op = sinks is not None or self.window_left is not None or context_parallel
        if needs_op and not self.backend.runs_as_op():
            raise ValueError(
                f"attention sinks, sliding windows and context parallelism need a backend "
                f"the registered op runs; {self.backend.name!r} is not one"
            )
        if needs_op:
            return segment_attention(q, k, v, self.handle, scale, sinks)[0]
        raise_if_unmet(self.backend, KernelTarget.of(q))
        store = self.kv_store
        running = store.running if store is not None else None
        documents = None
        if running is not None:
            k, v = store.attach(self, k, v)
            documents = running.kernel_documents
        return self.backend(q, k, v, scale, documents)

    def extra_repr(self) -> str:
        window = "" if self.window_left is None else f", window_left={self.window_left}"
        return f"backend={self.backend.name}{window}"


def bind_documents(module: nn.Module, ids: torch.Tensor | None) -> KVStore | None:
    """Give an unsplit ``module``'s attention packed documents, outside any pipeline.

    ids: (batch, seq_len) document ids of the next forward's inputs,
    non-decreasing along each row. Every segment-aware layer in ``module``
    (softmax and linear attention, :func:`bind_attention`) is bound to a store
    whose running unit is the whole sequence with these documents; it stays
    in effect through backward and activation-checkpoint recompute, until
    the next call. ``None`` restores plain causal attention. Returns the
    store (None for ``ids=None``).
    """
    if ids is None:
        bind_attention(module, None)
        return None
    if ids.dim() != 2:
        raise ValueError(f"document ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
    error = check_document_ids(ids, *ids.shape)
    if error is not None:
        raise ValueError(error)
    plan = SegmentPlan.from_lengths((ids.shape[1],))
    store = KVStore()
    store.running = RunningUnit(Unit(0, 0), plan, MicrobatchDocuments(ids, plan))
    bind_attention(module, store)
    return store


def wrap_attention(
    model: nn.Module,
    is_attention: Callable[[str, nn.Module], bool],
    backend: str | AttentionBackend = "auto",
    module_class: type[SegmentAwareAttention] = SegmentAwareAttention,
) -> int:
    """Replace every submodule selected by ``is_attention(name, module)`` in place.

    Each becomes a ``module_class(backend)`` (a subclass takes another
    framework's call signature). Returns the number of modules replaced; each
    replacement shares nothing with the others, so each keeps its own K/V per
    microbatch.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if name and is_attention(name, module)
    ]
    for name, _ in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, module_class(backend))
    return len(targets)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Per-microbatch K/V of earlier segments, and the unit that is running.

Segment j of microbatch i attends to the keys/values of segments 0..j of the
same microbatch. 1F1B interleaves microbatches, so K/V live per (attention
layer, microbatch) in a buffer preallocated for the whole sequence and written
in place, one segment's slice at a time: a segment's attention reads a view of
the prefix instead of concatenating a copy of it. With packed documents the
buffer starts at the first key a later segment reads back
(:attr:`~torchtitan_seq1f1b.documents.MicrobatchDocuments.keep_from`), and a
segment reads only from its documents' first key.

The store also says which unit its stage is computing (``KVStore.running``).
That is plain state, not a ``ContextVar`` or thread-local: on CUDA, autograd
runs backward, custom Function backwards and activation-checkpoint recompute
on a per-device worker thread, which sees no context set by the schedule's
thread. One unit runs per stage at a time and the schedule's thread blocks
while its backward runs, so state owned by the store is what every thread
sees.

Gradients flow back the other way: the backward of segment j yields dK/dV for
the whole prefix; the part for earlier segments is accumulated in a gradient
buffer and added to those segments' own dK/dV when their backward runs
(segments of a microbatch run backward last-to-first on every stage).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.documents import MicrobatchDocuments, SegmentDocuments
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["KVStore", "RunningUnit"]


class _PrefixBuffers:
    """K/V (and their pending gradients) of one attention layer for one microbatch.

    Buffers hold positions ``[low, seq_len)``, laid out (batch, seq_len - low,
    n_kv_heads, head_dim), the layout varlen kernels consume, so a prefix is a
    zero-copy slice. ``low`` is 0 for causal attention; with packed documents
    it is the first key a later segment reads back. Gradients are banked for
    positions ``[low, grad_end)``: those a later segment can attend.
    """

    def __init__(self, like: torch.Tensor, low: int, seq_len: int, grad_end: int):
        batch, _, n_kv_heads, head_dim = like.shape
        shape = (batch, max(seq_len - low, 0), n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.low = low
        self.grad_end = grad_end
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        grads = self.grad_k.nbytes + self.grad_v.nbytes if self.grad_k is not None else 0
        return self.k.nbytes + self.v.nbytes + grads

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the part of a segment's K/V (from ``start``) at or after ``low``."""
        skip = max(self.low - start, 0)
        if skip >= k.shape[1]:
            return
        begin, end = start + skip - self.low, start + k.shape[1] - self.low
        # Through .data so the buffers' version counter does not move: earlier
        # segments saved views of earlier positions for backward, and this write
        # only touches [begin, end). Recompute writes the same values again.
        self.k.data[:, begin:end].copy_(k[:, skip:])
        self.v.data[:, begin:end].copy_(v[:, skip:])

    def views(self, key_start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[key_start, end)``, all at or after ``low``."""
        return self.k[:, key_start - self.low : end - self.low], self.v[:, key_start - self.low : end - self.low]

    def take_grads(
        self, key_start: int, start: int, end: int, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank the prefix part of (grad_k, grad_v); return this segment's part.

        grad_k/grad_v: (batch, end - key_start, n_kv_heads, head_dim), gradients
        of the keys ``[key_start, end)`` this segment attended to. The returned
        (batch, end - start, ...) part is a view of them, with what later
        segments banked for these positions added in place.
        """
        own = start - key_start
        # Bank positions [key_start, reach): the prefix, and the own positions
        # later segments banked gradients for (up to grad_end).
        reach = max(min(end, self.grad_end), start)
        if self.grad_k is None:
            if own > 0:
                self._open_bank(grad_k, key_start, start)
                for bank, grad in ((self.grad_k, grad_k), (self.grad_v, grad_v)):
                    bank[:, key_start - self.low : start - self.low].copy_(grad[:, :own])
        elif reach > max(key_start, self.low):
            # One pass per tensor: the prefix's gradients go into the bank and,
            # summed in the bank's precision, the own positions' come back.
            lo, own_lo = max(key_start, self.low), max(start, self.low)
            for bank, grad in ((self.grad_k, grad_k), (self.grad_v, grad_v)):
                banked = bank[:, lo - self.low : reach - self.low]
                banked += grad[:, lo - key_start : reach - key_start]
                if reach > own_lo:
                    grad[:, own_lo - key_start : reach - key_start].copy_(banked[:, own_lo - lo :])
        if start <= self.low:
            # No earlier segment reads the bank: it goes before the microbatch's W steps.
            self.grad_k = self.grad_v = None
        return grad_k[:, own:], grad_v[:, own:]

    def _open_bank(self, like: torch.Tensor, first: int, stop: int) -> None:
        """fp32 (or wider) banks for positions ``[low, grad_end)``; the first write
        fills ``[first, stop)``, so only the rest starts at zero."""
        # bf16/fp16 gradients are summed over up to k segments: keep fp32.
        dtype = like.dtype if like.dtype.itemsize >= 4 else torch.float32
        length = max(self.grad_end - self.low, 0)
        shape = (like.shape[0], length, *like.shape[2:])
        self.grad_k = torch.empty(shape, dtype=dtype, device=like.device)
        self.grad_v = torch.empty(shape, dtype=dtype, device=like.device)
        for bank in (self.grad_k, self.grad_v):
            if first > self.low:
                bank[:, : first - self.low].zero_()
            if stop < self.grad_end:
                bank[:, stop - self.low :].zero_()


class _AttachToPrefix(torch.autograd.Function):
    """Write a segment's K/V into its microbatch's buffers; return the keys it attends.

    Those are buffer views of ``[key_start, end)``, or the segment's own K/V
    when the buffers start after ``key_start`` (then ``key_start == start``:
    the segment reads nothing back).
    """

    @staticmethod
    def forward(ctx, k, v, buffers: _PrefixBuffers, key_start: int, start: int, store: "KVStore"):
        buffers.write(start, k, v)
        end = start + k.shape[1]
        ctx.buffers, ctx.key_start, ctx.start, ctx.end, ctx.store = (
            buffers, key_start, start, end, store
        )
        if key_start >= buffers.low:
            return buffers.views(key_start, end)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        like = ctx.buffers.k
        shape = (like.shape[0], ctx.end - ctx.key_start, *like.shape[2:])
        if grad_k is None:
            grad_k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if grad_v is None:
            grad_v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        own_k, own_v = ctx.buffers.take_grads(
            ctx.key_start, ctx.start, ctx.end, grad_k, grad_v
        )
        ctx.store.record_peak()  # gradient buffers appear during backward
        return own_k, own_v, None, None, None, None


class KVStore:
    """K/V prefixes of one pipeline stage, keyed by (attention layer, microbatch)."""

    def __init__(self):
        self._buffers: dict[tuple[nn.Module, int], _PrefixBuffers] = {}
        self.peak_bytes = 0
        self.running: RunningUnit | None = None

    @contextlib.contextmanager
    def running_unit(self, unit: "RunningUnit | None") -> Iterator[None]:
        """Make ``unit`` the one the attention layers bound to this store see,
        on whichever thread autograd runs them."""
        previous, self.running = self.running, unit
        try:
            yield
        finally:
            self.running = previous

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def attach(
        self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the running segment attends, its own slice differentiable.

        k, v: (batch, segment_len, n_kv_heads, head_dim) for the running segment.
        Returns two (batch, end - key_start, n_kv_heads, head_dim) tensors:
        positions ``[key_start, end)`` with ``key_start`` 0 for causal
        attention and :attr:`SegmentDocuments.key_start` with documents.
        """
        buffers, key_start, start = self._placed(layer, k)
        views = _AttachToPrefix.apply(k, v, buffers, key_start, start, self)
        self.record_peak()
        return views

    def prefix(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor, write: bool):
        """:meth:`attach` without autograd, for an op that computes its own gradients.

        ``write`` stores the segment's K/V (its forward); without it (its
        backward) the buffers already hold them. Returns the keys and values
        the segment attends, a function banking their gradients that returns
        the segment's own part, and the segment's documents (None if dense).
        """
        buffers, key_start, start = self._placed(layer, k)
        end = start + k.shape[1]
        if write:
            buffers.write(start, k, v)
            self.record_peak()
        keys, values = buffers.views(key_start, end) if key_start >= buffers.low else (k, v)

        def bank(grad_k: torch.Tensor, grad_v: torch.Tensor):
            own = buffers.take_grads(key_start, start, end, grad_k, grad_v)
            self.record_peak()
            return own

        return keys, values, bank, self.running.kernel_documents

    def _placed(self, layer: nn.Module, k: torch.Tensor) -> tuple[_PrefixBuffers, int, int]:
        """The running microbatch's buffers of ``layer``, the unit's first key and first position."""
        running = self.running
        if running is None:
            raise RuntimeError("KVStore.attach needs a running unit (see running_unit)")
        plan, (microbatch, segment) = running.plan, running.unit
        if k.shape[1] != plan.lengths[segment]:
            raise ValueError(
                f"segment {segment} of {plan} has {plan.lengths[segment]} tokens but "
                f"attention received {k.shape[1]}; inputs must be cut with this plan"
            )
        key = (layer, microbatch)
        buffers = self._buffers.get(key)
        if buffers is None:
            if segment != 0:
                raise RuntimeError(
                    f"K/V of microbatch {microbatch} were freed before segment "
                    f"{segment} ran; segments must run in order"
                )
            buffers = _PrefixBuffers(k, running.keep_from, plan.seq_len, plan.offsets[-1])
            self._buffers[key] = buffers
        return buffers, running.key_start, plan.offsets[segment]

    def record_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def free(self, microbatch: int) -> None:
        """Drop every layer's K/V of ``microbatch`` (its last backward has run)."""
        for key in [key for key in self._buffers if key[1] == microbatch]:
            del self._buffers[key]

    def clear(self) -> None:
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)


@dataclass(frozen=True)
class RunningUnit:
    """The unit a stage is computing, with the plan that places its tokens.

    ``documents``: its microbatch's packed documents, None for causal attention.
    """

    unit: Unit
    plan: SegmentPlan
    documents: MicrobatchDocuments | None = None

    @property
    def segment_documents(self) -> SegmentDocuments | None:
        if self.documents is None:
            return None
        return self.documents.segment(self.unit.segment)

    @property
    def kernel_documents(self) -> SegmentDocuments | None:
        """The documents a kernel must mask by: None when the segment is dense."""
        documents = self.segment_documents
        return None if documents is None or documents.dense else documents

    @property
    def key_start(self) -> int:
        """First key position the unit's queries see."""
        documents = self.segment_documents
        return 0 if documents is None else documents.key_start

    @property
    def keep_from(self) -> int:
        """First position the store keeps: 0 for causal attention (with one segment too,
        whose attention then saves views of the store, as much as unsplit attention
        saves), else the first key a later segment reads back (``seq_len``: none)."""
        return 0 if self.documents is None else self.documents.keep_from

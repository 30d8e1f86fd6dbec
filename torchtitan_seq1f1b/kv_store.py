# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Per-microbatch K/V of earlier segments, and the unit that is running.

Segment j of microbatch i attends to the keys/values of segments 0..j of the
same microbatch. 1F1B interleaves microbatches, so K/V live per (attention
layer, microbatch) in a buffer preallocated for the whole sequence and written
in place, one segment's slice at a time: a segment's attention reads a view of
the prefix instead of concatenating a copy of it.

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
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["KVStore", "RunningUnit"]


class _PrefixBuffers:
    """K/V (and their pending gradients) of one attention layer for one microbatch.

    Buffers are laid out (batch, seq_len, n_kv_heads, head_dim), the layout
    varlen kernels consume, so a prefix is a zero-copy slice.
    """

    def __init__(self, like: torch.Tensor, seq_len: int, grad_len: int):
        batch, _, n_kv_heads, head_dim = like.shape
        shape = (batch, seq_len, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.grad_len = grad_len
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        grads = self.grad_k.nbytes + self.grad_v.nbytes if self.grad_k is not None else 0
        return self.k.nbytes + self.v.nbytes + grads

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[1]
        # Through .data so the buffers' version counter does not move: earlier
        # segments saved views of [0, start) for backward, and this write only
        # touches [start, end). Recompute writes the same values again.
        self.k.data[:, start:end].copy_(k)
        self.v.data[:, start:end].copy_(v)

    def take_grads(
        self, start: int, end: int, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank the prefix part of (grad_k, grad_v); return this segment's part.

        grad_k/grad_v: (batch, end, n_kv_heads, head_dim), gradients of the
        prefix view [0, end) this segment attended to.
        """
        own_k, own_v = grad_k[:, start:end], grad_v[:, start:end]
        if self.grad_k is not None and end <= self.grad_len:
            # Later segments already attended to this slice: add what they left.
            own_k = own_k + self.grad_k[:, start:end].to(own_k.dtype)
            own_v = own_v + self.grad_v[:, start:end].to(own_v.dtype)
        if start > 0:
            if self.grad_k is None:
                # bf16/fp16 gradients are summed over up to k segments: keep fp32.
                dtype = torch.promote_types(grad_k.dtype, torch.float32)
                shape = (grad_k.shape[0], self.grad_len, *grad_k.shape[2:])
                self.grad_k = torch.zeros(shape, dtype=dtype, device=grad_k.device)
                self.grad_v = torch.zeros(shape, dtype=dtype, device=grad_k.device)
            self.grad_k[:, :start] += grad_k[:, :start]
            self.grad_v[:, :start] += grad_v[:, :start]
        return own_k, own_v


class _AttachToPrefix(torch.autograd.Function):
    """Write a segment's K/V into its microbatch's buffers; return the prefix views."""

    @staticmethod
    def forward(ctx, k, v, buffers: _PrefixBuffers, start: int, store: "KVStore"):
        buffers.write(start, k, v)
        end = start + k.shape[1]
        ctx.buffers, ctx.start, ctx.end, ctx.store = buffers, start, end, store
        return buffers.k[:, :end], buffers.v[:, :end]

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        grad_k = torch.zeros_like(ctx.buffers.k[:, : ctx.end]) if grad_k is None else grad_k
        grad_v = torch.zeros_like(ctx.buffers.v[:, : ctx.end]) if grad_v is None else grad_v
        own_k, own_v = ctx.buffers.take_grads(ctx.start, ctx.end, grad_k, grad_v)
        ctx.store.record_peak()  # gradient buffers appear during backward
        return own_k, own_v, None, None, None


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
        """K/V of segments 0..segment of the running unit, its own slice differentiable.

        k, v: (batch, segment_len, n_kv_heads, head_dim) for the running segment.
        Returns two (batch, segment_end, n_kv_heads, head_dim) views.
        """
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
            buffers = _PrefixBuffers(k, plan.seq_len, plan.offsets[-1])
            self._buffers[key] = buffers
        views = _AttachToPrefix.apply(k, v, buffers, plan.offsets[segment], self)
        self.record_peak()
        return views

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
    """The unit a stage is computing, with the plan that places its tokens."""

    unit: Unit
    plan: SegmentPlan

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

A sliding-window layer (``window_left`` set) keeps less: per later segment,
only the keys before it that its window reaches, and a gradient bank of as
many positions (:class:`_WindowTails`).

A layer that carries state of its own across segments (GatedDeltaNet's conv
tail and recurrent state, :mod:`torchtitan_seq1f1b.linear_attention.carry`)
keeps it here too, per (layer, microbatch), with the same lifetime
(:meth:`KVStore.layer_state`).
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.context_parallel import ContextGroup
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
        self.written_end = low  # recompute finds its segment's K/V here already
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
        self.written_end = max(self.written_end, end + self.low)

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


class _WindowTails:
    """K/V of one sliding-window attention layer for one microbatch.

    Segment j attends the keys ``[key_start_j, end_j)``: its tail ``[key_start_j,
    start_j)``, at most ``window_left`` positions copied when segment j - 1 ran, then
    its own K/V, which the registered op saves. So a layer keeps per microbatch
    one tail per segment instead of the whole sequence, until the microbatch is
    freed: under checkpointing a weight-gradient step recomputes the segment's
    forward after its input-gradient step. Tail gradients are banked for the
    earlier segments' backward, again at most ``window_left`` positions.
    """

    def __init__(self):
        self.tails: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next_tail = 1  # recompute must not take a tail again once its segment ran
        self.bank_start = 0
        self.bank: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        kept = [x for pair in (*self.tails.values(), self.bank or ()) for x in pair]
        return sum(x.nbytes for x in kept)

    def attended(self, segment: int, k: torch.Tensor, v: torch.Tensor):
        """Keys and values segment ``segment`` attends: its tail, then its own k and v."""
        tail = self.tails.get(segment)
        if tail is None:
            return k, v
        return torch.cat((tail[0], k), dim=1), torch.cat((tail[1], v), dim=1)

    def keep_tail(self, segment: int, cut: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep ``keys[:, cut:]`` (and values') as the tail of ``segment``: the attended
        keys of the segment before it from its own first key on."""
        if segment < self.next_tail:
            return
        self.next_tail = segment + 1
        if cut < keys.shape[1]:
            self.tails[segment] = (keys[:, cut:].clone(), values[:, cut:].clone())

    def take_grads(
        self, segment: int, key_start: int, start: int, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank the tail part of a segment's key gradients, add what the later segment
        banked, return the segment's own part.

        grad_k/grad_v: (batch, end - key_start, n_kv_heads, head_dim), gradients of
        the keys ``[key_start, end)`` segment ``segment`` (from ``start``) attended.
        """
        own, lo = start - key_start, self.bank_start - key_start
        kept = []
        for grad, banked in zip((grad_k, grad_v), self.bank or (None, None)):
            # bf16/fp16 gradients are summed over segments: keep fp32.
            dtype = grad.dtype if grad.dtype.itemsize >= 4 else torch.float32
            tail = grad[:, :own].to(dtype, copy=True)
            if banked is not None:
                # The bank holds keys [bank_start, start): from index lo of these.
                first_own = max(lo, own)
                grad[:, first_own:].copy_(grad[:, first_own:] + banked[:, first_own - lo :])
                if lo < own:
                    tail[:, lo:] += banked[:, : own - lo]
            kept.append(tail)
        self.bank = tuple(kept) if own > 0 else None
        self.bank_start = key_start
        return grad_k[:, own:], grad_v[:, own:]


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
    """K/V prefixes of one pipeline stage, keyed by (attention layer, microbatch), and the
    per-microbatch state of layers that carry their own (:meth:`layer_state`)."""

    def __init__(self):
        # Attention layers' K/V; other layers' own per-microbatch state (layer_state).
        self._buffers: dict[tuple[nn.Module, int], object] = {}
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
        backward, or a recompute that :meth:`holds` them) the buffers already
        hold them, and k and v may be None where the buffers hold the segment. Returns the keys and values
        the segment attends, a function banking their gradients that returns
        the segment's own part, and the segment's documents (None if dense).
        A layer with a ``window_left`` keeps and reads only its window's keys (without
        context parallelism).
        """
        if getattr(layer, "window_left", None) is not None and self.running.context is None:
            # Under CP the store keeps every segment's gathered K/V, windowed or not.
            return self._window_prefix(layer, k, v, write)
        buffers, key_start, start = self._placed(layer, k)
        end = self.running.plan.ends[self.running.unit.segment]
        if write:
            buffers.write(start, k, v)
            self.record_peak()
        keys, values = buffers.views(key_start, end) if key_start >= buffers.low else (k, v)

        def bank(grad_k: torch.Tensor, grad_v: torch.Tensor):
            own = buffers.take_grads(key_start, start, end, grad_k, grad_v)
            self.record_peak()
            return own

        return keys, values, bank, self.running.kernel_documents

    def layer_state(self, layer: nn.Module, create: Callable[[], object], like: torch.Tensor):
        """The running microbatch's state of a layer that keeps its own (a linear-attention
        layer's carries), made by ``create`` for its segment 0 and freed with the
        microbatch's K/V. like: (batch, segment_len, ...), checked to be the running
        segment's tokens."""
        self._checked_running(like)
        return self._layer_buffers(layer, create)

    def holds(self, layer: nn.Module) -> bool:
        """Whether ``layer``'s buffers hold the running segment's K/V: it ran forward
        before (a checkpoint recomputes it), so its K/V need not be gathered again."""
        buffers = self._buffers.get((layer, self.running.unit.microbatch))
        if not isinstance(buffers, _PrefixBuffers):
            return False
        plan, segment = self.running.plan, self.running.unit.segment
        return buffers.low <= plan.offsets[segment] and buffers.written_end >= plan.ends[segment]

    def _window_prefix(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor, write: bool):
        """:meth:`prefix` of a sliding-window layer (see :class:`_WindowTails`)."""
        running = self._checked_running(k)
        plan, (_, segment) = running.plan, running.unit
        tails = self._layer_buffers(layer, _WindowTails)
        layout = running.window_documents(layer.window_left, k)
        keys, values = tails.attended(segment, k, v)
        if write and segment + 1 < len(plan.lengths):
            following = running.window_documents(layer.window_left, k, segment + 1)
            tails.keep_tail(segment + 1, following.key_start - layout.key_start, keys, values)
            self.record_peak()

        def bank(grad_k: torch.Tensor, grad_v: torch.Tensor):
            own = tails.take_grads(segment, layout.key_start, layout.start, grad_k, grad_v)
            self.record_peak()
            return own

        return keys, values, bank, None if layout.dense else layout

    def _placed(self, layer: nn.Module, k: torch.Tensor) -> tuple[_PrefixBuffers, int, int]:
        """The running microbatch's buffers of ``layer``, the unit's first key and first position."""
        running = self._checked_running(k)
        plan = running.plan
        buffers = self._layer_buffers(
            layer, lambda: _PrefixBuffers(k, running.keep_from, plan.seq_len, plan.offsets[-1])
        )
        return buffers, running.key_start, plan.offsets[running.unit.segment]

    def _checked_running(self, k: torch.Tensor | None) -> "RunningUnit":
        """The running unit, once ``k`` (if given) is checked to be its segment's."""
        running = self.running
        if running is None:
            raise RuntimeError("KVStore.attach needs a running unit (see running_unit)")
        plan, segment = running.plan, running.unit.segment
        if k is not None and k.shape[1] != plan.lengths[segment]:
            raise ValueError(
                f"segment {segment} of {plan} has {plan.lengths[segment]} tokens but "
                f"a layer received {k.shape[1]}; inputs must be cut with this plan"
            )
        return running

    def _layer_buffers(self, layer: nn.Module, create: Callable):
        """``layer``'s buffers for the running microbatch, created by its first segment."""
        microbatch, segment = self.running.unit
        buffers = self._buffers.get((layer, microbatch))
        if buffers is None:
            if segment != 0:
                raise RuntimeError(
                    f"K/V (or state) of microbatch {microbatch} were freed before segment "
                    f"{segment} ran; segments must run in order"
                )
            buffers = self._buffers[layer, microbatch] = create()
        return buffers

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
    ``context``: the CP group the unit's tokens are shared over, None without CP;
    the plan then places the whole segment, of which this rank holds a share.
    """

    unit: Unit
    plan: SegmentPlan
    documents: MicrobatchDocuments | None = None
    context: ContextGroup | None = None

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

    def window_documents(
        self, window_left: int, like: torch.Tensor, segment: int | None = None
    ) -> SegmentDocuments:
        """A sliding-window layer's layout of ``segment`` (default: the unit's), its
        rows each one document when the microbatch has none; ``like``: a (batch, ...) tensor."""
        documents = self.documents
        if documents is None:
            documents = MicrobatchDocuments.whole_rows(like.shape[0], self.plan, like.device)
        return documents.segment(self.unit.segment if segment is None else segment, window_left)

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
        if self.documents is None or self.context is not None:
            # Under CP the store also keeps every segment's gathered K/V for its backward.
            return 0
        return self.documents.keep_from

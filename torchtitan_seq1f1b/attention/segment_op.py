# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware attention as one registered op per call, opaque to torch.compile.

A compiled block sees ``seq1f1b::segment_attention`` and nothing of the K/V
store or the running unit, so it neither breaks its graph nor guards on the
unit: the op's implementation reaches both through a zero-element buffer
the layer holds, its handle, which names the layer and the store it is bound
to (:mod:`.binding`). The handle is a graph input like any other, so layers
share one compiled graph. Each binding gets a new handle, and the
backward gets the handle its forward saved: under torch's own schedules,
where the next microbatch's forward rebinds the documents before this one's
backward, the backward still sees its own.

The op returns the output and the kernel's logsumexp; its backward is a
second op computing (dq, dk, dv) with the kernel's backward and banking the
prefix part of dk/dv in the store, as :class:`~torchtitan_seq1f1b.kv_store.KVStore`
does for eager attention.

With attention sinks (gpt_oss) the output is rescaled per head,
``out * sigmoid(lse - sinks)``: softmax over the keys and one more, zero-valued
key of logit ``sinks[h]``. The rescaled output is the attention output over
that longer key set, so the kernel's backward, given it in place of ``out``
and ``grad * sigmoid(lse - sinks)`` in place of ``grad``, returns the exact
dq, dk, dv: kernels use ``out`` only for ``rowsum(grad * out)``.
"""

import torch

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention.backend import KernelTarget
from torchtitan_seq1f1b.attention.binding import bound_to
from torchtitan_seq1f1b.attention.choice import raise_if_unmet
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["segment_attention"]


def _bound(handle: torch.Tensor):
    """(layer, store, running unit) of a handle; the unit is None outside a unit."""
    layer, store = bound_to(handle, "segment_attention")
    return layer, store, None if store is None else store.running


def _prefix(handle: torch.Tensor, k: torch.Tensor, v: torch.Tensor, write: bool):
    """(layer, keys, values, bank, documents) of the running segment
    (:meth:`KVStore.prefix`); outside a unit its own k and v, no bank, and no
    documents but a sliding window's."""
    layer, store, running = _bound(handle)
    if running is None:
        window_left = getattr(layer, "window_left", None)
        if window_left is None:
            return layer, k, v, None, None
        whole = RunningUnit(Unit(0, 0), SegmentPlan.from_lengths((k.shape[1],)))
        layout = whole.window_documents(window_left, k)
        return layer, k, v, None, None if layout.dense else layout
    return layer, *store.prefix(layer, k, v, write)


def _sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """sigmoid(lse - sinks): lse (batch, heads, Lq), sinks (heads,) -> (batch, Lq, heads, 1)."""
    return torch.sigmoid(lse - sinks.to(lse.dtype)[:, None]).transpose(1, 2)[..., None]


@torch.library.custom_op("seq1f1b::segment_attention", mutates_args=())
def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (batch, Lq, heads, head_dim); k, v: (batch, Lq, kv_heads, head_dim), the running
    segment's own; sinks: (heads,) or None. Returns out (batch, Lq, heads, head_dim),
    sink-rescaled if sinks are given, and the kernel's logsumexp (batch, heads, Lq)."""
    layer, store, running = _bound(handle)
    if running is not None and running.context is not None:
        out, lse = _context_parallel_forward(q, k, v, layer, store, running, scale)
    else:
        layer, keys, values, _, documents = _prefix(handle, k, v, write=True)
        raise_if_unmet(layer.backend, KernelTarget.of(q))
        out, lse = layer.backend.forward(q, keys, values, scale, documents)
    if sinks is not None:
        out = out * _sink_scale(lse, sinks).to(out.dtype)
    return out, lse


def _pieces(running: RunningUnit, keys: torch.Tensor, window_left: int | None) -> list[tuple]:
    """Per head-tail piece of this CP rank's share: its rows of the share, its keys
    (a slice of ``keys``, the store's view from the unit's first key) and its
    documents (None where dense); with ``window_left``, a sliding-window layer's."""
    plan, segment = running.plan, running.unit.segment
    spans = running.context.layout.spans(plan.offsets[segment], plan.lengths[segment])
    size = spans[0][1] - spans[0][0]
    microbatch = running.documents
    if microbatch is None and window_left is not None:
        microbatch = MicrobatchDocuments.whole_rows(keys.shape[0], plan, keys.device)
    pieces = []
    for i, (start, end) in enumerate(spans):
        documents = None if microbatch is None else microbatch.span(start, end, window_left)
        key_start = running.key_start if documents is None else documents.key_start
        keys_of_piece = slice(key_start - running.key_start, end - running.key_start)
        if documents is not None and documents.dense:
            documents = None
        if documents is not None and documents.varlen is None:
            # Keys are the store's rows, seq_len apart (the store keeps all under CP).
            documents.upload_varlen(keys.device, keys.stride(0) // keys.stride(1))
        pieces.append((slice(i * size, (i + 1) * size), keys_of_piece, documents))
    return pieces


def _context_parallel_forward(q, k, v, layer, store, running, scale):
    """The op's forward on a CP rank: q, k, v are its share of the segment (two
    head-tail pieces). The segment's K/V are gathered into the store, unless a
    checkpoint recomputes a segment whose K/V the store holds already; each piece
    attends bottom-right causally (within its documents) to the keys up to its end."""
    if store.holds(layer):
        keys, values, _, _ = store.prefix(layer, None, None, write=False)
    else:
        keys, values, _, _ = store.prefix(layer, *running.context.gather(k, v), write=True)
    raise_if_unmet(layer.backend, KernelTarget.of(q))
    outs, lses = zip(*(
        layer.backend.forward(q[:, rows], keys[:, span], values[:, span], scale, documents)
        for rows, span, documents in _pieces(running, keys, getattr(layer, "window_left", None))
    ))
    return torch.cat(outs, 1), torch.cat(lses, -1)


def _context_parallel_backward(grad, q, out, lse, layer, store, running, scale):
    """The op's backward on a CP rank: each piece's dk/dv summed over the keys it
    attended, the prefix part banked, and the segment's own part reduce-scattered
    to the ranks' shares."""
    keys, values, bank, _ = store.prefix(layer, None, None, write=False)
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    grad_q = []
    for rows, span, documents in _pieces(running, keys, getattr(layer, "window_left", None)):
        dq, dk, dv = layer.backend.backward(
            grad[:, rows], q[:, rows], keys[:, span], values[:, span], out[:, rows],
            lse[..., rows], scale, documents,
        )
        grad_q.append(dq)
        grad_k[:, span] += dk
        grad_v[:, span] += dv
    dk, dv = running.context.reduce_scatter(*bank(grad_k, grad_v))
    # One reduce-scatter returns both as views of one tensor; an op's returns may not alias.
    return torch.cat(grad_q, 1).contiguous(), dk, dv.clone()


@segment_attention.register_fake
def _(q, k, v, handle, scale, sinks=None):
    # The kernel's logsumexp is fp32 for half inputs, else the inputs' dtype.
    lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype)


@torch.library.custom_op("seq1f1b::segment_attention_backward", mutates_args=())
def segment_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the running segment's q, k, v; the prefix part of dk/dv goes to the store."""
    layer, store, running = _bound(handle)
    if running is not None and running.context is not None:
        return _context_parallel_backward(grad, q, out, lse, layer, store, running, scale)
    layer, keys, values, bank, documents = _prefix(handle, k, v, write=False)
    dq, dk, dv = layer.backend.backward(grad, q, keys, values, out, lse, scale, documents)
    if bank is not None:
        dk, dv = bank(dk, dv)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@segment_attention_backward.register_fake
def _(grad, q, k, v, out, lse, handle, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, handle, scale, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, handle, sinks)
    ctx.scale = scale


def _backward_formula(ctx, grad, _grad_lse):
    q, k, v, out, lse, handle, sinks = ctx.saved_tensors
    grad_sinks = None
    if sinks is not None:
        sink_scale = _sink_scale(lse, sinks)
        # d(out * s)/d(sinks) = -out * s * (1 - s), per head, summed over batch and queries.
        grad_sinks = -((grad * out).sum(-1, keepdim=True) * (1 - sink_scale)).sum((0, 1, 3))
        grad = grad * sink_scale.to(grad.dtype)
    dq, dk, dv = segment_attention_backward(grad, q, k, v, out, lse, handle, ctx.scale)
    return dq, dk, dv, None, None, None if grad_sinks is None else grad_sinks.to(sinks.dtype)


segment_attention.register_autograd(_backward_formula, setup_context=_setup_context)

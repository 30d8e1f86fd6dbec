# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""GatedDeltaNet's two segment-aware ops, registered so torch.compile sees each as one call.

Both take activations only: the conv weight, the gates' parameters and the
projections stay outside, in autograd, so a split backward (input gradients
in one step, weight gradients in a later one) works as for any layer, and
these ops' backwards run once per segment, in its input-gradient step.

- ``seq1f1b::gdn_conv_tail``: the segment's pre-conv inputs (q, k and v
  channels side by side) after the conv tail it carries in, and each token's
  index in its document. Its backward banks the tail's gradient for the
  segment before and adds what the segment after banked.
- ``seq1f1b::gdn_recurrence``: the gated delta rule from the state the
  segment carries in (zero where a row's document starts at the cut); the
  final state goes to the next segment. Its backward takes the next
  segment's banked gradient as the final state's (fla's ``dht``) and banks
  the initial state's (``dh0``).

Like ``seq1f1b::segment_attention`` the ops reach the layer and the stage's
K/V store through the layer's handle (:mod:`torchtitan_seq1f1b.attention.binding`);
the carries live there (:mod:`.carry`). Outside a unit a row is one sequence
from zero state (with packed documents bound as a one-segment unit, see
:func:`~torchtitan_seq1f1b.attention.bind_documents`). A
checkpoint recompute reads the same carries and keeps nothing again.
"""

import torch

from torchtitan_seq1f1b.attention import KernelTarget
from torchtitan_seq1f1b.attention.binding import bound_to
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import RunningUnit
from torchtitan_seq1f1b.linear_attention.backends import check_recurrence_backend
from torchtitan_seq1f1b.linear_attention.carry import LayerCarries

__all__ = ["conv_tail", "recurrence"]


def _carries(handle: torch.Tensor, like: torch.Tensor):
    """(carries, running unit, store) of the running segment, or Nones outside a unit.

    like: (B, L, ...) the segment's tokens, checked against the plan.
    """
    layer, store = bound_to(handle, "a GatedDeltaNet op")
    running = None if store is None else store.running
    if running is None:
        return None, None, None
    if running.context is not None:
        raise NotImplementedError("GatedDeltaNet layers do not run under context parallelism")
    return store.layer_state(layer, LayerCarries, like), running, store


def _backend(handle: torch.Tensor, q: torch.Tensor):
    """The layer's recurrence backend for q (B, L, HV, K)'s device, dtype and K."""
    layer, _ = bound_to(handle, "a GatedDeltaNet op")
    return check_recurrence_backend(layer.config.recurrence_backend, KernelTarget.of(q))


def _documents(running: RunningUnit | None, handle: torch.Tensor) -> MicrobatchDocuments | None:
    """The running microbatch's documents as the layer restarts its state at them."""
    if running is None or running.documents is None:
        return None
    layer, _ = bound_to(handle, "a GatedDeltaNet op")
    if layer.config.merge_single_token_documents:
        return running.documents.single_tokens_merged
    return running.documents


def _segment_documents(running: RunningUnit | None, handle: torch.Tensor):
    documents = _documents(running, handle)
    return None if documents is None else documents.segment(running.unit.segment)


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last n positions of (B, T, ...) x (none for n = 0)."""
    return x[:, x.shape[1] - n :]


def _document_positions(
    running: RunningUnit | None, handle: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """(B, L) int64: each token's index in its document; like: (B, L, ...) on the device.

    Without documents a row is one document, so this is the token's position.
    """
    batch, length = like.shape[:2]
    start = 0 if running is None else running.plan.offsets[running.unit.segment]
    positions = torch.arange(start, start + length, device=like.device)
    documents = _documents(running, handle)
    if documents is None:
        return positions.expand(batch, length).contiguous()
    return positions - documents.device_starts[:, start : start + length]


@torch.library.custom_op("seq1f1b::gdn_conv_tail", mutates_args=())
def conv_tail(x: torch.Tensor, handle: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, L, C) the segment's pre-conv inputs. Returns the conv window
    (B, width - 1 + L, C), the ``width - 1`` inputs before the segment (zeros
    before the sequence) then x, and each token's index in its document (B, L) int64."""
    carries, running, store = _carries(handle, x)
    batch, length, channels = x.shape
    tail = None if carries is None else carries.conv_tail.incoming(running.unit.segment)
    if tail is None:
        tail = x.new_zeros(batch, width - 1, channels)
    window = torch.cat((tail, x), dim=1)
    segment = None if running is None else running.unit.segment
    if carries is not None and segment + 1 < running.plan.num_segments:
        # The window's last W - 1 rows: from its tail too when the segment is shorter than that.
        if carries.conv_tail.keep(segment + 1, _last(window, width - 1).clone()):
            store.record_peak()
    return window, _document_positions(running, handle, x)


@conv_tail.register_fake
def _(x, handle, width):
    batch, length, channels = x.shape
    positions = x.new_empty((batch, length), dtype=torch.int64)
    return x.new_empty((batch, width - 1 + length, channels)), positions


@torch.library.custom_op("seq1f1b::gdn_conv_tail_backward", mutates_args=())
def conv_tail_backward(grad_window: torch.Tensor, handle: torch.Tensor, width: int) -> torch.Tensor:
    """grad_window: (B, width - 1 + L, C). Returns the gradient of the segment's
    own inputs (B, L, C), with what the next segment banked for them added."""
    own = grad_window[:, width - 1 :]
    carries, running, store = _carries(handle, own)
    if carries is None:
        # A copy: contiguous() of a batch-1 slice is that slice, and an op must not alias its input.
        return own.clone(memory_format=torch.contiguous_format)
    segment = running.unit.segment
    last = segment + 1 == running.plan.num_segments
    banked = carries.conv_tail.take_grad(segment, last)
    grad = grad_window.to(torch.promote_types(grad_window.dtype, torch.float32), copy=True)
    if banked is not None:
        # The next segment's tail: this segment's last inputs (and, if it is short, earlier ones).
        _last(grad, width - 1).add_(banked)
    carries.conv_tail.bank_grad(segment, grad[:, : width - 1])
    store.record_peak()
    return grad[:, width - 1 :].to(grad_window.dtype).contiguous()


@conv_tail_backward.register_fake
def _(grad_window, handle, width):
    batch, window, channels = grad_window.shape
    return grad_window.new_empty((batch, window - (width - 1), channels))


def _conv_tail_setup(ctx, inputs, output):
    _, handle, width = inputs
    ctx.save_for_backward(handle)
    ctx.width = width


def _conv_tail_grad(ctx, grad_window, _grad_positions):
    (handle,) = ctx.saved_tensors
    return conv_tail_backward(grad_window, handle, ctx.width), None, None


conv_tail.register_autograd(_conv_tail_grad, setup_context=_conv_tail_setup)


@torch.library.custom_op("seq1f1b::gdn_recurrence", mutates_args=())
def recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_positions: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The gated delta rule of the running segment (:func:`.delta_rule.delta_rule_forward`),
    on the layer's backend.

    q, k: (B, L, H, K) before L2 norm, heads repeated to the value heads;
    v: (B, L, H, V); g, beta: (B, L, H); doc_positions: (B, L) int, each
    token's index in its document (0 resets the state). Returns o (B, L, H, V).
    """
    carries, running, store = _carries(handle, q)
    initial = None if carries is None else carries.state.incoming(running.unit.segment)
    o, final = _backend(handle, q).forward(
        q, k, v, g, beta, scale, initial, doc_positions, _segment_documents(running, handle)
    )
    if carries is not None and running.unit.segment + 1 < running.plan.num_segments:
        if carries.state.keep(running.unit.segment + 1, final):
            store.record_peak()
    return o


@recurrence.register_fake
def _(q, k, v, g, beta, doc_positions, handle, scale):
    return v.new_empty(v.shape)


@torch.library.custom_op("seq1f1b::gdn_recurrence_backward", mutates_args=())
def recurrence_backward(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_positions: torch.Tensor,
    handle: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta) of the running segment; the initial state's gradient
    goes to the store for the segment before."""
    carries, running, store = _carries(handle, q)
    initial = grad_final = None
    if carries is not None:
        segment = running.unit.segment
        initial = carries.state.incoming(segment)
        grad_final = carries.state.take_grad(segment, segment + 1 == running.plan.num_segments)
    grads = _backend(handle, q).backward(
        grad_o, grad_final, q, k, v, g, beta, scale, initial, doc_positions,
        _segment_documents(running, handle),
    )
    if carries is not None:
        carries.state.bank_grad(running.unit.segment, grads.initial_state)
        store.record_peak()
    return grads.q, grads.k, grads.v, grads.g, grads.beta


@recurrence_backward.register_fake
def _(grad_o, q, k, v, g, beta, doc_positions, handle, scale):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _recurrence_setup(ctx, inputs, output):
    *tensors, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.scale = scale


def _recurrence_grad(ctx, grad_o):
    q, k, v, g, beta, doc_positions, handle = ctx.saved_tensors
    grads = recurrence_backward(grad_o, q, k, v, g, beta, doc_positions, handle, ctx.scale)
    return *grads, None, None, None


recurrence.register_autograd(_recurrence_grad, setup_context=_recurrence_setup)

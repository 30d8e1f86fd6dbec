# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a GatedDeltaNet layer carries from one segment of a microbatch to the next.

Two things cross a cut, per row: the conv tail (the last ``W - 1`` pre-conv
inputs before the segment) and the recurrent state ``S``. Each is a
:class:`Carry`: segment j's forward keeps the value segment j + 1 starts
from, and segment j + 1's backward banks that value's gradient for segment
j's backward (segments of a microbatch run backward last to first).

A layer's :class:`LayerCarries` live in the stage's
:class:`~torchtitan_seq1f1b.kv_store.KVStore` beside the attention layers'
K/V, keyed by (layer, microbatch) (:meth:`KVStore.layer_state`): they are
created by the microbatch's segment 0, freed with its K/V, cleared every
step, and counted in the store's bytes and peak.

Values stay until the microbatch is freed, not until their segment's
backward: a checkpointed segment's forward is recomputed in its backward and
again in every weight-gradient step (each is a new autograd graph task),
and every recompute must start from the same tail and state. A forward that
finds the next segment's value kept already is such a recompute and writes
nothing.
"""

import torch

__all__ = ["Carry", "LayerCarries"]


class Carry:
    """One carried tensor of one layer and microbatch: per segment, the value it
    starts from, and the gradient banked for the segment whose backward is next."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.grad: torch.Tensor | None = None
        self.grad_for = -1  # the segment whose backward the bank is for

    @property
    def nbytes(self) -> int:
        grad = 0 if self.grad is None else self.grad.nbytes
        return sum(x.nbytes for x in self.values.values()) + grad

    def incoming(self, segment: int) -> torch.Tensor | None:
        """The value ``segment`` starts from; None for segment 0 (zeros)."""
        if segment == 0:
            return None
        if segment not in self.values:
            raise RuntimeError(
                f"segment {segment - 1} kept no value for segment {segment}: segments of "
                "a microbatch must run forward first to last"
            )
        return self.values[segment]

    def keep(self, segment: int, value: torch.Tensor) -> bool:
        """Keep what ``segment`` starts from, unless kept already (a recompute).

        Returns whether it was kept.
        """
        if segment in self.values:
            return False
        self.values[segment] = value
        return True

    def take_grad(self, segment: int, last: bool) -> torch.Tensor | None:
        """The gradient banked for ``segment``'s outgoing value (None for the
        microbatch's ``last`` segment, which passes nothing on)."""
        if last:
            return None
        if self.grad_for != segment:
            raise RuntimeError(
                f"segment {segment + 1} banked no gradient for segment {segment}: segments "
                "of a microbatch must run backward last to first, each once"
            )
        grad, self.grad, self.grad_for = self.grad, None, -1
        return grad

    def bank_grad(self, segment: int, grad: torch.Tensor) -> None:
        """Bank the gradient of ``segment``'s incoming value for ``segment - 1``'s backward."""
        if segment == 0:
            return  # nothing before the microbatch's start
        # bf16/fp16 gradients go on into earlier segments' sums: keep fp32.
        dtype = torch.promote_types(grad.dtype, torch.float32)
        self.grad, self.grad_for = grad.to(dtype, copy=True), segment - 1


class LayerCarries:
    """A GatedDeltaNet layer's carries for one microbatch: the conv tail
    (B, W - 1, channels) and the recurrent state (B, H, K, V)."""

    def __init__(self):
        self.conv_tail = Carry()
        self.state = Carry()

    @property
    def nbytes(self) -> int:
        return self.conv_tail.nbytes + self.state.nbytes

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One microbatch run segment by segment on one device, as a Seq1F1B stage runs it.

No process group and no pipeline: every segment's forward runs in order under
its (microbatch, segment) unit on a :class:`KVStore`, then every segment's
backward runs last segment first, each under its unit again (activation
checkpoint recompute and the K/V gradient routing need it). This is what one
stage does for one microbatch under any Seq1F1B schedule, so comparing a
:class:`SegmentedRun` with unsplit ``fn(*inputs)`` checks attention across
segments (and linear attention's carried state), its gradient routing and
checkpointing without a pipeline.
"""

import torch
import torch.nn as nn

from torchtitan_seq1f1b.attention import bind_attention
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["SegmentedRun"]


class SegmentedRun:
    """``fn(*inputs)`` for one microbatch, run segment by segment.

    Args:
        fn: the module to run; its segment-aware layers (softmax and linear
            attention) are bound to ``store``.
        inputs: tensors with the sequence on ``seq_dim``: e.g. token ids
            (batch, seq_len) with ``seq_dim=1``, or q/k/v
            (batch, heads, seq_len, head_dim) with ``seq_dim=2``. Each segment
            gets its slice; floating-point slices are fresh leaves, so their
            gradients come back per segment (:meth:`grads`).
        plan: how the sequence is cut.
        store: the K/V store of the (single) stage.
        microbatch: the microbatch index of the units.
        positions_kwarg: when set, ``fn`` also gets this keyword with the
            segment's global positions, ``offset + arange(length)`` of shape
            (1, length), as the schedules pass them.
        document_ids: (batch, seq_len) packed-document ids of the microbatch,
            as a schedule's ``document_ids_kwarg`` takes them; None is causal.
    """

    def __init__(
        self,
        fn: nn.Module,
        inputs: list[torch.Tensor] | tuple[torch.Tensor, ...],
        plan: SegmentPlan,
        store: KVStore,
        microbatch: int = 0,
        seq_dim: int = 1,
        positions_kwarg: str | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        bind_attention(fn, store)
        self.documents = None if document_ids is None else MicrobatchDocuments(document_ids, plan)
        self.fn, self.inputs, self.plan = fn, list(inputs), plan
        self.store, self.microbatch = store, microbatch
        self.seq_dim, self.positions_kwarg = seq_dim, positions_kwarg
        self.outs: list[torch.Tensor | None] = [None] * plan.num_segments
        self.leaves: list[list[torch.Tensor] | None] = [None] * plan.num_segments

    def _unit(self, segment: int):
        unit = RunningUnit(Unit(self.microbatch, segment), self.plan, self.documents)
        return self.store.running_unit(unit)

    def _cut(self, x: torch.Tensor, segment: int) -> torch.Tensor:
        return x.narrow(self.seq_dim, self.plan.offsets[segment], self.plan.lengths[segment])

    def forward(self, segment: int) -> torch.Tensor:
        """Run segment ``segment``'s forward; returns (and keeps) its output."""
        leaves = []
        for x in self.inputs:
            part = self._cut(x, segment).detach()
            leaves.append(part.requires_grad_() if part.is_floating_point() else part)
        kwargs = {}
        if self.positions_kwarg is not None:
            start, end = self.plan.offsets[segment], self.plan.ends[segment]
            device = self.inputs[0].device
            kwargs[self.positions_kwarg] = torch.arange(start, end, device=device)[None]
        with self._unit(segment):
            self.outs[segment] = self.fn(*leaves, **kwargs)
        self.leaves[segment] = leaves
        return self.outs[segment]

    def backward(self, segment: int, grad_out: torch.Tensor | None = None) -> None:
        """Back-propagate segment ``segment``'s output.

        grad_out: the gradient of the whole microbatch's output (cut here on
        ``seq_dim``), or None when ``fn`` returns a scalar (a segment's loss).
        """
        out = self.outs[segment]
        gradient = None if grad_out is None else self._cut(grad_out, segment)
        with self._unit(segment):
            out.backward(gradient)

    def output(self) -> torch.Tensor:
        """The segments' outputs joined on ``seq_dim``."""
        return torch.cat([out.detach() for out in self.outs], dim=self.seq_dim)

    def grads(self) -> list[torch.Tensor]:
        """Gradient of every floating-point input, segments joined on ``seq_dim``."""
        return [
            torch.cat([leaves[i].grad for leaves in self.leaves], dim=self.seq_dim)
            for i, x in enumerate(self.inputs)
            if x.is_floating_point()
        ]

    def run(self, grad_out: torch.Tensor | None = None):
        """All forwards in order, then all backwards last to first; frees the store.

        Returns (:meth:`output`, :meth:`grads`); ``fn``'s output must carry
        the sequence on ``seq_dim``.
        """
        for segment in range(self.plan.num_segments):
            self.forward(segment)
        for segment in reversed(range(self.plan.num_segments)):
            self.backward(segment, grad_out)
        self.store.free(self.microbatch)
        return self.output(), self.grads()

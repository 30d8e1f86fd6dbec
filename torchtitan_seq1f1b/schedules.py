# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B schedules: torch's pipeline runtime over (microbatch, segment) units.

Each microbatch is cut into the segments of a :class:`SegmentPlan` and the
pipeline runs segments as its units of work (arXiv 2406.03488). Rank 0 then
holds ``(p + k - 1) / k`` microbatches of activations instead of 1F1B's ``p``,
and the bubble shrinks from ``(p-1)/(m+p-1)`` to ``(p-1)/(m*k+p-1)``.
Gradients equal those of unsplit training: attention layers wrapped in
:class:`~torchtitan_seq1f1b.attention.SegmentAwareAttention` see every earlier
segment of their microbatch, and linear-attention layers
(:class:`~torchtitan_seq1f1b.linear_attention.SegmentAwareGatedDeltaNet`)
continue from its state.

torch's runtime sees unit (i, j) as its microbatch (chunk id) ``i*k + j``, so
its lowering passes, send/receive machinery and FSDP hooks run unchanged;
this class builds and validates the unit order, sizes each chunk's receive
buffers for its segment, and turns per-unit losses back into per-microbatch
ones.

- :class:`ScheduleSeq1F1B`: one stage per rank, 1F1B over units.
- :class:`ScheduleInterleavedSeq1F1B`: several stages per rank (loop placement).
- :class:`ScheduleSeq1F1BZeroBubble`: one stage per rank, backwards split into
  input- and weight-gradient steps, weight gradients in the bubbles (ZB-H1 style).
- :class:`ScheduleSeq1F1BZBV`: two stages per rank in a V, split backwards (ZB-V style).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b._torch_compat import (
    _Action,
    PipelineRuntime,
    lower_forward_only,
    resize_recv_buffers,
    set_finalize_gradients,
    wrap_stage_compute,
)
from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.attention import bind_attention, SegmentAwareAttention
from torchtitan_seq1f1b.context_parallel import ContextGroup
from torchtitan_seq1f1b.documents import MicrobatchDocuments, upload_varlen_layouts
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.orders import (
    interleaved_seq1f1b_order,
    lower_order,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    v_stage_to_rank,
    validate_order,
)
from torchtitan_seq1f1b.stepping.microbatch_inputs import split_microbatches
from torchtitan_seq1f1b.stepping.parameter_grads import parameter_grads_kept
from torchtitan_seq1f1b.stepping.receives import receives_first
from torchtitan_seq1f1b.stepping.rank_errors import InputCheck
from torchtitan_seq1f1b.stepping.segment_inputs import SegmentSplitter
from torchtitan_seq1f1b.stepping.stage_layout import (
    check_context_parallel_plan,
    check_loop_placement,
    check_one_stage_per_rank,
    check_plan,
    check_v_placement,
)
from torchtitan_seq1f1b.stepping.unit_compute import UnitComputeScope
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "ScheduleSeq1F1BZBV",
    "ScheduleSeq1F1BZeroBubble",
]


class ScheduleSeq1F1B(PipelineRuntime):
    """Seq1F1B with one pipeline stage per rank.

    Constructed and stepped like torch's schedules: ``step(*args, target=...,
    losses=..., **kwargs)`` takes whole batches, splits them into
    ``n_microbatches`` along the batch dim and each microbatch into the plan's
    segments along ``seq_dim``; targets and sequence-shaped keyword tensors
    are cut the same way. ``losses`` receives one value per real microbatch:
    what ``loss_fn`` returned, summed over the microbatch's segments (like
    torch's schedules, the reported losses are not normalised).

    Gradients are those of ``sum(losses) / normaliser``. The normaliser is
    ``loss_normalizer`` when set (e.g. the valid-token count of the global
    batch under data parallelism or gradient accumulation, as torchtitan's
    trainer computes it), else the step's valid target tokens when
    ``scale_grads``, else 1.

    Args:
        stages: this rank's stage (a one-element list, or the stage itself).
        n_microbatches: real microbatches per step (m).
        segment_plan: how every sequence is cut (k = ``segment_plan.num_segments``).
        loss_fn: ``loss_fn(output, target) -> tensor`` returning the *sum* of
            the per-token losses of a segment. A mean per segment would weight
            tokens unequally across segments.
        scale_grads: divide every segment's loss by the step's number of
            valid target tokens (``target != ignore_index``) so gradients are
            those of the mean loss of the unsplit batch; ``False`` keeps sums.
        seq_dim: sequence dim of inputs, targets and stage activations.
        positions_kwarg: keyword through which the model takes global token
            positions (RoPE). When set and the caller passes none, each unit
            gets ``offset_j + arange(len_j)`` of shape (1, len_j).
        ignore_index: target value that does not count as a token.
        document_ids_kwarg: keyword through which ``step()`` and ``eval()``
            take packed-document ids, (batch, seq_len) integers non-decreasing
            along each row, on every rank. Attention then restricts each query
            to earlier keys of its own document, across segments; the model
            itself never receives the ids. A step without them is causal.
        context_parallel: this rank's CP group (context parallelism of degree
            c): every unit runs on this rank's head-tail share of its segment,
            ``len_j / c`` tokens, and attention gathers each segment's K/V over
            the group. Segment lengths must be multiples of ``2 * c``; inputs,
            targets and positions are whole sequences, cut here; outputs are
            this rank's shares. Gradients, summed over the group, are those of
            the unsplit batch: every rank normalises by the whole batch's valid
            tokens, counted from the targets before they are cut.
        whole_kwargs: keyword tensors every unit gets uncut, even where a dim
            ``seq_dim`` happens to have ``seq_len`` entries (a microbatch's
            image patches, ``(num_images, patches, patch_dim)``).
    """

    def __init__(
        self,
        stages: list[_PipelineStageBase] | _PipelineStageBase,
        n_microbatches: int,
        segment_plan: SegmentPlan,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        seq_dim: int = 1,
        positions_kwarg: str | None = None,
        ignore_index: int = -100,
        document_ids_kwarg: str | None = None,
        context_parallel: ContextGroup | None = None,
        whole_kwargs: tuple[str, ...] = (),
    ):
        stages = [stages] if isinstance(stages, _PipelineStageBase) else list(stages)
        check_plan(n_microbatches, segment_plan)
        if context_parallel is not None:
            check_context_parallel_plan(segment_plan, context_parallel.layout)
        self._context = context_parallel
        self._check_stage_layout(stages)
        self.segment_plan = segment_plan
        self.num_segments = segment_plan.num_segments
        self.n_real_microbatches = n_microbatches
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches * self.num_segments,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            # Normalisation happens per segment loss (see _compute_loss); the
            # runtime must not divide again by its microbatch (unit) count.
            scale_grads=False,
        )
        self._place_stages()
        self.loss_normalizer: float | torch.Tensor | None = None
        self._normalize_loss = scale_grads
        self._step_normalizer: float | torch.Tensor = 1.0
        self._segment_loss_sums: list[torch.Tensor] = []
        self._seq_dim = seq_dim
        self._ignore_index = ignore_index
        layout = None if context_parallel is None else context_parallel.layout
        self._splitter = SegmentSplitter(
            segment_plan, seq_dim, positions_kwarg, layout, frozenset(whole_kwargs)
        )
        self._document_ids_kwarg = document_ids_kwarg
        self.kv_stores = {stage.stage_index: KVStore() for stage in stages}
        self._unit_scope = UnitComputeScope(
            segment_plan, self.kv_stores, seq_dim, context_parallel
        )
        self._input_check = InputCheck(type(self).__name__, frozenset(whole_kwargs))
        for stage in stages:
            wrap_stage_compute(stage, self._unit_scope)

        self.segment_order = self._build_segment_order()
        validate_order(
            self.segment_order,
            self._num_stages,
            n_microbatches,
            self.num_segments,
            self._stage_to_rank,
        )
        self.pipeline_order = lower_order(self.segment_order, self.num_segments)
        self._prepare_schedule_with_comms(self.pipeline_order)
        self._train_order_with_comms = self._place_receives(self.pipeline_order_with_comms)
        # eval() runs the forwards alone: torch's runtime would otherwise step
        # through no-op backwards, and hand-offs between two stages on one rank
        # (the V) refuse to run without a backward.
        forwards_only = {
            rank: [a for a in actions if a.kind == "F"]
            for rank, actions in self.segment_order.items()
        }
        self._eval_order_with_comms = self._place_receives(
            lower_forward_only(self, lower_order(forwards_only, self.num_segments))
        )

    def _place_receives(self, order: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
        # See schedule/receives.py: early receives help gloo and would stall NCCL.
        return receives_first(order) if self._stages[0].device.type == "cpu" else order

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_one_stage_per_rank(stages, "ScheduleSeq1F1B")

    def _place_stages(self) -> None:
        """Set which rank runs each stage; torch's default is the loop ``s % p``."""

    def _build_segment_order(self) -> Order:
        return self.order_for(
            self.pp_group_size, len(self._stages), self.n_real_microbatches, self.num_segments
        )

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        """Every rank's compute order, without building stages (the planner replays it).

        Subclasses return their variant's; this one is Seq1F1B's, one stage per rank.
        """
        return seq1f1b_order(num_ranks * stages_per_rank, n_microbatches, num_segments)

    def _stage_to_rank(self, stage_index: int) -> int:
        return self.stage_index_to_group_rank[stage_index]

    @property
    def _chunk_seq_lens(self) -> list[int]:
        degree = 1 if self._context is None else self._context.layout.degree
        return [n // degree for n in self.segment_plan.lengths] * self.n_real_microbatches

    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
        with parameter_grads_kept(self._stages):
            super()._initialize_stages(args, kwargs, target, loss_kwargs)
        for stage in self._stages:
            resize_recv_buffers(stage, self._chunk_seq_lens, self._seq_dim)

    def _compute_loss(self, output, target, loss_kwargs=None):
        loss_sum = super()._compute_loss(output, target, loss_kwargs)
        self._segment_loss_sums.append(loss_sum.detach())
        return loss_sum / self._step_normalizer

    def _update_losses(self, stages, losses):
        """Report one loss per real microbatch: its segments' summed ``loss_fn`` values."""
        if self._internal_losses:
            k = self.num_segments
            sums = self._segment_loss_sums
            self._internal_losses = [
                torch.stack(sums[i : i + k]).sum() for i in range(0, len(sums), k)
            ]
        self._segment_loss_sums = []
        saved, self._n_microbatches = self._n_microbatches, self.n_real_microbatches
        try:
            super()._update_losses(stages, losses)
        finally:
            self._n_microbatches = saved

    def step(
        self,
        *args,
        target=None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[tuple] | None = None,
        kwarg_mbs: list[dict] | None = None,
        target_mbs: list | None = None,
        finalize_gradients: bool = True,
        **kwargs,
    ):
        """One pipeline step over whole-batch or pre-split inputs; see the class docstring.

        ``arg_mbs``/``kwarg_mbs``/``target_mbs`` take microbatches the caller
        already split (one entry per real microbatch, as torch 2.14+'s
        schedules take them); ``finalize_gradients=False`` (torch 2.15+)
        leaves FSDP gradients unreduced for a later step.
        """
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() runs backward and cannot be used under torch.no_grad(); "
                "call eval() instead"
            )
        set_finalize_gradients(self, finalize_gradients)
        inputs = split_microbatches(
            self._splitter,
            self.n_real_microbatches,
            args,
            kwargs,
            target,
            arg_mbs,
            kwarg_mbs,
            target_mbs,
            (self._args_chunk_spec, self._kwargs_chunk_spec),
            self._document_ids_kwarg,
        )
        self._input_check(self._stages[0], self._has_backward, inputs)
        self.pipeline_order_with_comms = (
            self._train_order_with_comms if self._has_backward else self._eval_order_with_comms
        )
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        for stage in self._stages:
            store = self.kv_stores[stage.stage_index]
            store.clear()
            # Every step, so layers wrapped after construction are bound too.
            bind_attention(stage.submod, store)

        documents = None
        if inputs.document_ids is not None:
            documents = [
                MicrobatchDocuments(ids, self.segment_plan, starts)
                for ids, starts in zip(inputs.document_ids, inputs.document_starts)
            ]
            if self._context is None:  # CP attention lays out its pieces itself
                upload_varlen_layouts(documents, self._stages[0].device, self._windows())
        self._unit_scope.documents = documents
        split, device = self._splitter, self._stages[0].device
        arg_units = [u for mb in inputs.args for u in split.split_args(mb)]
        kwarg_units = [u for mb in inputs.kwargs for u in split.split_kwargs(mb, device)]
        target_units = None
        self._segment_loss_sums = []
        if inputs.targets is not None:
            self._step_normalizer = self._normalizer_for(inputs.targets)
            target_units = [u[0] for mb in inputs.targets for u in split.split_args((mb,))]

        self._step_microbatches(
            arg_units, kwarg_units, target_units, losses, return_outputs, loss_kwargs
        )
        for stage in self._stages:
            if stage.is_last and return_outputs:
                return split.merge_outputs(stage.output_chunks, self._output_merge_spec)
        return None

    def _windows(self) -> list[int]:
        """The sliding windows (``window_left``) of this rank's attention layers."""
        layers = (m for stage in self._stages for m in stage.submod.modules())
        return sorted({
            m.window_left for m in layers
            if isinstance(m, SegmentAwareAttention) and m.window_left is not None
        })

    def _normalizer_for(self, targets: list[torch.Tensor]) -> float | torch.Tensor:
        if self.loss_normalizer is not None:
            return self.loss_normalizer
        if self._normalize_loss:
            # One host sync for the step, not one per microbatch.
            valid = int(sum((t != self._ignore_index).sum() for t in targets))
            return float(max(valid, 1))
        return 1.0


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """Seq1F1B with several stages (model chunks) per rank, loop placement.

    Rank r holds stages ``r, r + p, ..., r + (v-1)*p``, as for torch's
    ``ScheduleInterleaved1F1B``, and runs interleaved 1F1B over the m*k units
    (:func:`~torchtitan_seq1f1b.orders.interleaved_seq1f1b_order`). The bubble
    shrinks to ``(p-1)/(v*m*k + p-1)``; rank 0 holds about
    ``((v+1)*p + k - 2) / (v*k)`` microbatches of activations. Any m and k
    work; with k = 1 the order is torch's Interleaved1F1B order.

    Takes the same arguments as :class:`ScheduleSeq1F1B`, with ``stages`` the
    list of this rank's v >= 2 stages.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_loop_placement(stages, "ScheduleInterleavedSeq1F1B")

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return interleaved_seq1f1b_order(num_ranks, stages_per_rank, n_microbatches, num_segments)


class ScheduleSeq1F1BZeroBubble(ScheduleSeq1F1B):
    """Seq1F1B with split backwards, ZB-H1 style; one stage per rank.

    Every unit's backward runs as an input-gradient step (I, what the previous
    stage waits for) and a weight-gradient step (W). Rank r defers its W steps
    by r, so they fill the cooldown where a later rank would idle, while no
    rank holds more units awaiting W than Seq1F1B's rank 0 holds awaiting
    backward (p + k - 1). The bubble drops to roughly a third of Seq1F1B's
    when I and W cost about a forward each
    (:func:`~torchtitan_seq1f1b.orders.seq1f1b_zero_bubble_order`).

    On the first stage torch computes the whole backward in the W step (its
    inputs are tokens), so W steps of a microbatch run last segment first, as
    the K/V gradient routing needs; I steps on other stages carry the K/V
    prefix gradients, and W steps only read the banked activation gradients.
    Takes the same arguments as :class:`ScheduleSeq1F1B`.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_one_stage_per_rank(stages, "ScheduleSeq1F1BZeroBubble")

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return seq1f1b_zero_bubble_order(
            num_ranks * stages_per_rank, n_microbatches, num_segments
        )


class ScheduleSeq1F1BZBV(ScheduleSeq1F1B):
    """Seq1F1B with split backwards on a V of two stages per rank (ZB-V style).

    Rank r holds stages r and 2p-1-r, as for torch's ``ScheduleZBVZeroBubble``
    (build the stages with that placement). Units run down the ranks on the
    first chunk and back up on the second, in ZB-V's warmup/steady/cooldown
    pattern with the second chunk's forwards ``r + k - 1`` units ahead of its
    input gradients; at most ``2 * (p + k - 1)`` half-stage units await their
    weight gradient (Seq1F1B's rank-0 activation memory)
    (:func:`~torchtitan_seq1f1b.orders.seq1f1b_zbv_order`). With k = 1 it
    runs torch's ZBVZeroBubble order. Any m and k work. Takes the same
    arguments as :class:`ScheduleSeq1F1B`, with ``stages`` this rank's two
    stages.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_v_placement(stages, "ScheduleSeq1F1BZBV")

    def _place_stages(self) -> None:
        place = v_stage_to_rank(self.pp_group_size)
        self.stage_index_to_group_rank = {s: place(s) for s in range(self._num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return seq1f1b_zbv_order(num_ranks, n_microbatches, num_segments)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B schedules: pipelines over (microbatch, sequence segment) units.

Each microbatch is cut into the segments of a :class:`SegmentPlan` and the
pipeline runs segments as its units of work (arXiv 2406.03488). Rank 0 then
holds ``(p + k - 1) / k`` microbatches of activations instead of 1F1B's ``p``,
and the bubble shrinks from ``(p-1)/(m+p-1)`` to ``(p-1)/(m*k+p-1)``.
Gradients equal those of unsplit training: attention layers wrapped in
:class:`SegmentAwareAttention` see every earlier segment of their microbatch.

- :class:`ScheduleSeq1F1B`: one stage per rank, 1F1B over units.
- :class:`ScheduleInterleavedSeq1F1B`: several stages per rank (loop
  placement), interleaved 1F1B over units.
- :class:`ScheduleSeq1F1BZeroBubble`: one stage per rank, every backward split
  into input- and weight-gradient steps, weight gradients deferred into the
  bubbles (ZB-H1 style).
- :class:`ScheduleSeq1F1BZBV`: two stages per rank in a V, split backwards
  (ZB-V style).
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import (
    merge_chunks,
    split_args_kwargs_into_chunks,
    TensorChunkSpec,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b._torch_compat import (
    _PipelineScheduleRuntime,
    lower_forward_only,
    resize_recv_buffers,
    runtime_validation_disabled,
    wrap_stage_compute,
)
from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.attention import bind_attention
from torchtitan_seq1f1b.kv_store import KVStore, SegmentUnit
from torchtitan_seq1f1b.orders import (
    interleaved_seq1f1b_order,
    lower_order,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    v_stage_to_rank,
    validate_order,
)
from torchtitan_seq1f1b.segmenting import scaled_seq_len, SegmentPlan

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "ScheduleSeq1F1BZBV",
    "ScheduleSeq1F1BZeroBubble",
]


class ScheduleSeq1F1B(_PipelineScheduleRuntime):
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
    ):
        stages = [stages] if isinstance(stages, _PipelineStageBase) else list(stages)
        _check_plan(n_microbatches, segment_plan)
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
            # runtime must not divide again by the virtual microbatch count.
            scale_grads=False,
        )
        self._place_stages()
        self.loss_normalizer: float | torch.Tensor | None = None
        self._normalize_loss = scale_grads
        self._step_normalizer: float | torch.Tensor = 1.0
        self._segment_loss_sums: list[torch.Tensor] = []
        self._seq_dim = seq_dim
        self._positions_kwarg = positions_kwarg
        self._ignore_index = ignore_index
        self.kv_stores = {stage.stage_index: KVStore() for stage in stages}
        self._reference_output_lens: dict[int, list[int]] = {}
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
        self._train_order_with_comms = self.pipeline_order_with_comms
        # eval() runs the forwards alone: torch's runtime would otherwise step
        # through no-op backwards, and hand-offs between two stages on one rank
        # (the V) refuse to run without a backward.
        forwards_only = {
            rank: [a for a in actions if a.kind == "F"]
            for rank, actions in self.segment_order.items()
        }
        self._eval_order_with_comms = lower_forward_only(
            lower_order(forwards_only, self.num_segments),
            self._stage_to_rank,
            self._num_stages,
        )

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        _check_one_stage_per_rank(stages, "ScheduleSeq1F1B")

    def _place_stages(self) -> None:
        """Set which rank runs each stage; torch's default is the loop ``s % p``."""

    def _build_segment_order(self) -> Order:
        """Every rank's compute order; subclasses replace it with their variant's."""
        return seq1f1b_order(
            self._num_stages, self.n_real_microbatches, self.num_segments
        )

    def _stage_to_rank(self, stage_index: int) -> int:
        return self.stage_index_to_group_rank[stage_index]

    @property
    def _chunk_seq_lens(self) -> list[int]:
        return list(self.segment_plan.lengths) * self.n_real_microbatches

    # ---- per-unit context -------------------------------------------------

    @contextlib.contextmanager
    def _unit_scope(
        self, stage: _PipelineStageBase, chunk_id: int, kind: str
    ) -> Iterator[None]:
        microbatch, segment = divmod(chunk_id, self.num_segments)
        store = self.kv_stores[stage.stage_index]
        unit = SegmentUnit(microbatch, segment, self.segment_plan)
        uneven = len(set(self.segment_plan.lengths)) > 1
        with store.running_unit(unit), (
            runtime_validation_disabled(stage) if uneven else contextlib.nullcontext()
        ):
            yield
        if kind == "F" and not stage.is_last:
            self._check_segment_outputs(stage, chunk_id, segment)
        last_segment_done = (
            (kind in ("B", "W") and segment == 0)
            or (kind == "F" and not stage.has_backward and segment == self.num_segments - 1)
        )
        if last_segment_done:
            store.free(microbatch)

    def _check_segment_outputs(
        self, stage: _PipelineStageBase, chunk_id: int, segment: int
    ) -> None:
        """Every output must hold its segment's tokens the way chunk 0's held its own.

        Receive buffers are sized from that ratio (1, or 1/tp for plain local
        tensors under sequence parallel), so a stage that changes it would
        corrupt the next stage's input.
        """
        outputs, _ = stage.fwd_cache[chunk_id]
        lens = [o.shape[self._seq_dim] for o in outputs if isinstance(o, torch.Tensor)]
        if chunk_id == 0:
            self._reference_output_lens[stage.stage_index] = lens
        tokens = self.segment_plan.lengths
        for length, reference in zip(lens, self._reference_output_lens[stage.stage_index]):
            expected = scaled_seq_len(reference, tokens[0], tokens[segment])
            if length != expected:
                raise ValueError(
                    f"stage {stage.stage_index} produced an output with {length} entries "
                    f"on dim seq_dim={self._seq_dim} for segment {segment} of "
                    f"{self.segment_plan}, expected {expected}; stage outputs must "
                    "keep their segment's tokens on seq_dim"
                )

    # ---- torch runtime hooks ------------------------------------------------

    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
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

    # ---- step -------------------------------------------------------------------

    def step(
        self,
        *args,
        target=None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ):
        """One pipeline step over whole-batch inputs; see the class docstring."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() runs backward and cannot be used under torch.no_grad(); "
                "call eval() instead"
            )
        self._raise_on_any_rank(self._input_error(args, target))
        self.pipeline_order_with_comms = (
            self._train_order_with_comms if self._has_backward else self._eval_order_with_comms
        )
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        for stage in self._stages:
            store = self.kv_stores[stage.stage_index]
            store.clear()
            # Every step, so attention wrapped after construction is bound too.
            bind_attention(stage.submod, store)

        m = self.n_real_microbatches
        args_mbs, kwargs_mbs = (
            split_args_kwargs_into_chunks(
                args, kwargs, m, self._args_chunk_spec, self._kwargs_chunk_spec
            )
            if args or kwargs
            else ([()] * m, [{}] * m)
        )
        arg_units = [u for mb in args_mbs for u in self._segment_args(mb)]
        kwarg_units = [u for mb in kwargs_mbs for u in self._segment_kwargs(mb)]
        target_units = None
        self._segment_loss_sums = []
        if target is not None:
            self._step_normalizer = self._normalizer_for(target)
            target_mbs, _ = split_args_kwargs_into_chunks((target,), None, m)
            target_units = [u[0] for mb in target_mbs for u in self._segment_args(mb)]

        self._step_microbatches(
            arg_units, kwarg_units, target_units, losses, return_outputs, loss_kwargs
        )
        for stage in self._stages:
            if stage.is_last and return_outputs:
                return self._merge_segment_outputs(stage.output_chunks)
        return None

    def _normalizer_for(self, target: torch.Tensor) -> float | torch.Tensor:
        if self.loss_normalizer is not None:
            return self.loss_normalizer
        if self._normalize_loss:
            return float(max(int((target != self._ignore_index).sum()), 1))
        return 1.0

    def _input_error(self, args: tuple, target: Any) -> str | None:
        """Why this rank's step inputs do not fit the segment plan, if they do not."""
        named = [("target", target)] + [(f"input {i}", a) for i, a in enumerate(args)]
        for what, tensor in named:
            if isinstance(tensor, torch.Tensor) and not self._is_sequence_shaped(tensor):
                return (
                    f"{what} of shape {tuple(tensor.shape)} does not have "
                    f"seq_len={self.segment_plan.seq_len} tokens on dim "
                    f"seq_dim={self._seq_dim}; build the SegmentPlan for the "
                    "training sequence length"
                )
        return None

    def _raise_on_any_rank(self, error: str | None) -> None:
        """Raise on every pipeline rank if any rank's inputs are bad.

        Only the first stage sees inputs and only the last sees targets; the
        others would otherwise wait forever for activations that never come.
        """
        stage = self._stages[0]
        flag = torch.tensor([error is not None], dtype=torch.int32, device=stage.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=stage.group)
        if flag.item() == 0:
            return
        errors: list = [None] * dist.get_world_size(stage.group)
        dist.all_gather_object(errors, error, group=stage.group)
        rank, message = next((r, e) for r, e in enumerate(errors) if e is not None)
        raise ValueError(f"ScheduleSeq1F1B.step: pipeline rank {rank}: {message}")

    def _split_seq(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(tensor, self.segment_plan.lengths, dim=self._seq_dim)

    def _is_sequence_shaped(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > self._seq_dim
            and value.shape[self._seq_dim] == self.segment_plan.seq_len
        )

    def _segment_args(self, mb_args: tuple) -> list[tuple]:
        """One microbatch's positional args -> one tuple per segment."""
        per_arg = [
            self._split_seq(a) if isinstance(a, torch.Tensor) else (a,) * self.num_segments
            for a in mb_args
        ]
        return [tuple(arg[j] for arg in per_arg) for j in range(self.num_segments)]

    def _segment_kwargs(self, mb_kwargs: dict) -> list[dict]:
        """One microbatch's keyword args -> one dict per segment, positions added."""
        units: list[dict] = [{} for _ in range(self.num_segments)]
        for name, value in mb_kwargs.items():
            parts = (
                self._split_seq(value)
                if self._is_sequence_shaped(value)
                else (value,) * self.num_segments
            )
            for unit, part in zip(units, parts):
                unit[name] = part
        if self._positions_kwarg and self._positions_kwarg not in mb_kwargs:
            device = self._stages[0].device
            plan = self.segment_plan
            for unit, start, end in zip(units, plan.offsets, plan.ends):
                unit[self._positions_kwarg] = torch.arange(start, end, device=device)[None]
        return units

    def _merge_segment_outputs(self, output_chunks: list) -> Any:
        k = self.num_segments
        per_microbatch = [
            torch.cat(output_chunks[i : i + k], dim=self._seq_dim)
            for i in range(0, len(output_chunks), k)
        ]
        return merge_chunks(per_microbatch, self._output_merge_spec)


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
        _check_loop_placement(stages, "ScheduleInterleavedSeq1F1B")

    def _build_segment_order(self) -> Order:
        return interleaved_seq1f1b_order(
            self.pp_group_size,
            len(self._stages),
            self.n_real_microbatches,
            self.num_segments,
        )


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
        _check_one_stage_per_rank(stages, "ScheduleSeq1F1BZeroBubble")

    def _build_segment_order(self) -> Order:
        return seq1f1b_zero_bubble_order(
            self._num_stages, self.n_real_microbatches, self.num_segments
        )


class ScheduleSeq1F1BZBV(ScheduleSeq1F1B):
    """Seq1F1B with split backwards on a V of two stages per rank (ZB-V style).

    Rank r holds stages r and 2p-1-r, as for torch's ``ScheduleZBVZeroBubble``
    (build the stages with that placement). Units run down the ranks on the
    first chunk and back up on the second; input gradients go first, forwards
    run while fewer than ``2 * (p + k - 1)`` half-stage units await their
    weight gradient (Seq1F1B's rank-0 activation memory), and weight gradients
    fill the gaps (:func:`~torchtitan_seq1f1b.orders.seq1f1b_zbv_order`).
    Any m and k work. Takes the same arguments as :class:`ScheduleSeq1F1B`,
    with ``stages`` this rank's two stages.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        first = stages[0]
        ranks, rank = first.group_size, first.group_rank
        expected = [rank, 2 * ranks - 1 - rank]
        if [s.stage_index for s in stages] != expected or first.num_stages != 2 * ranks:
            raise ValueError(
                f"ScheduleSeq1F1BZBV places two stages per rank in a V: with {ranks} "
                f"ranks, rank {rank} must hold stages {expected} of {2 * ranks}; got "
                f"stages {[s.stage_index for s in stages]} of {first.num_stages}"
            )

    def _place_stages(self) -> None:
        place = v_stage_to_rank(self.pp_group_size)
        self.stage_index_to_group_rank = {s: place(s) for s in range(self._num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    def _build_segment_order(self) -> Order:
        return seq1f1b_zbv_order(
            self.pp_group_size, self.n_real_microbatches, self.num_segments
        )


def _check_plan(n_microbatches: int, segment_plan: SegmentPlan) -> None:
    """Reject a bad plan or microbatch count before any collective runs."""
    if not isinstance(segment_plan, SegmentPlan):
        raise TypeError(
            f"segment_plan must be a SegmentPlan, got {type(segment_plan).__name__}; "
            "build one with SegmentPlan.uniform or SegmentPlan.balanced"
        )
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1")


def _check_one_stage_per_rank(stages: list[_PipelineStageBase], schedule: str) -> None:
    if len(stages) != 1:
        raise ValueError(
            f"{schedule} runs one stage per rank but got {len(stages)} stages; "
            "use ScheduleInterleavedSeq1F1B for several stages per rank"
        )
    stage = stages[0]
    if stage.num_stages != stage.group_size:
        raise ValueError(
            f"{schedule} needs num_stages == pipeline group size; got "
            f"{stage.num_stages} stages on {stage.group_size} ranks"
        )


def _check_loop_placement(stages: list[_PipelineStageBase], schedule: str) -> None:
    if len(stages) < 2:
        raise ValueError(
            f"{schedule} needs at least 2 stages per rank, got {len(stages)}; "
            "use ScheduleSeq1F1B for one stage per rank"
        )
    first = stages[0]
    ranks, rank = first.group_size, first.group_rank
    expected = [rank + chunk * ranks for chunk in range(len(stages))]
    if first.num_stages != len(stages) * ranks or [
        s.stage_index for s in stages
    ] != expected:
        raise ValueError(
            f"{schedule} places stages in a loop: with {ranks} ranks and "
            f"{len(stages)} stages per rank, rank {rank} must hold stages {expected} "
            f"of {len(stages) * ranks}; got stages "
            f"{[s.stage_index for s in stages]} of {first.num_stages}"
        )

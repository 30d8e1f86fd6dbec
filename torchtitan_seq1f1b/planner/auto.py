# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""From a job's shape and layout to a recommendation: calibrate (or read the cache), then choose."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.context_parallel import check_context_parallel
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig
from torchtitan_seq1f1b.planner.calibrate import (
    cached_calibration,
    chain_within,
    CalibrationTarget,
    rank_chain_length,
)
from torchtitan_seq1f1b.planner.choose import PARTITIONS, Recommendation, recommend
from torchtitan_seq1f1b.planner.estimate import PipelineShape
from torchtitan_seq1f1b.planner.time_model import ContextParallelCost, TimeModel
from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = [
    "AutoPlanRequest",
    "AutoPlan",
    "calibration_target",
    "plan_automatically",
    "recommend_for",
]

OrderFor = Callable[[int, int, int, int], Order]
"""``(num_ranks, stages_per_rank, n_microbatches, num_segments) -> Order``:
``ScheduleSeq1F1B.order_for`` and its variants'."""


@dataclass(frozen=True)
class AutoPlanRequest:
    """A job as the planner sees it.

    Args:
        shape: the model's dims.
        seq_len: tokens per sequence.
        num_ranks: pipeline ranks.
        stages_per_rank: stages on each rank (2 for the V and interleaved schedules).
        microbatches: microbatches per step.
        order_for: the schedule's order builder.
        align: every segment length is a multiple of it.
        device, dtype, microbatch_size, attention_backend: what to calibrate on.
        budget_bytes: activations + K/V store per rank (None: unbounded).
        partitions: the partitions to consider.
        segment_counts: the k tried.
        refresh: calibrate again even if the cache has this target.
        context_parallel: CP degree c inside every segment (1: none); lengths are
            then also multiples of 2c, and ``seq_len`` must be one.
        cp_bytes_per_second, cp_latency: the CP group's collectives
            (:class:`ContextParallelCost`).
    """

    shape: TransformerCost
    seq_len: int
    num_ranks: int
    stages_per_rank: int
    microbatches: int
    order_for: OrderFor
    align: int = 1
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    microbatch_size: int = 1
    attention_backend: str = "auto"
    budget_bytes: int | None = None
    partitions: tuple[str, ...] = field(default=PARTITIONS)
    segment_counts: tuple[int, ...] = tuple(range(1, 17))
    refresh: bool = False
    context_parallel: int = 1
    cp_bytes_per_second: float = ContextParallelCost.bytes_per_second
    cp_latency: float = ContextParallelCost.latency

    def __post_init__(self) -> None:
        cp = self.context_parallel
        if not isinstance(cp, int) or cp < 1:
            raise ValueError(f"context_parallel={cp!r} must be a positive int (1: no CP)")
        try:
            check_context_parallel(self.seq_len, self.align, cp)
        except ValueError as error:
            raise ValueError(f"context_parallel={cp}: {error}") from None
        ContextParallelCost(cp, self.cp_bytes_per_second, self.cp_latency)  # checks them

    @property
    def context_parallel_cost(self) -> ContextParallelCost:
        return ContextParallelCost(self.context_parallel, self.cp_bytes_per_second, self.cp_latency)


@dataclass(frozen=True)
class AutoPlan:
    """The recommendation, the time model behind it and where that came from."""

    recommendation: Recommendation
    time_model: TimeModel
    calibration_source: str


def calibration_target(request: AutoPlanRequest) -> CalibrationTarget:
    """What :func:`plan_automatically` times: a rank's blocks chained
    (:func:`rank_chain_length`), fewer where their activations over the
    whole sequence would not fit ``request.budget_bytes`` (one at least)."""
    target = CalibrationTarget(
        shape=request.shape,
        seq_len=request.seq_len,
        device=request.device,
        dtype=request.dtype,
        microbatch_size=request.microbatch_size,
        attention_backend=request.attention_backend,
        chained_blocks=rank_chain_length(request.shape.n_layers, request.num_ranks),
    )
    return chain_within(target, request.budget_bytes)


def plan_automatically(request: AutoPlanRequest) -> AutoPlan:
    """Calibrate ``request``'s model on its device (or read the cache) and pick the plan."""
    target = calibration_target(request)
    model, path, cached = cached_calibration(target, refresh=request.refresh)
    source = f"{'read from' if cached else 'measured, saved to'} {path}"
    return AutoPlan(recommend_for(request, model), model, source)


def recommend_for(request: AutoPlanRequest, model: TimeModel) -> Recommendation:
    """The plan ``request`` gets from an already calibrated ``model``."""
    stages = request.num_ranks * request.stages_per_rank

    def order(num_segments: int) -> Order:
        return request.order_for(
            request.num_ranks, request.stages_per_rank, request.microbatches, num_segments
        )

    return recommend(
        PipelineShape.even(request.shape.n_layers, stages, order, **_linear_fields(request)),
        model,
        request.shape,
        request.seq_len,
        align=request.align,
        budget_bytes=request.budget_bytes,
        partitions=request.partitions,
        segment_counts=request.segment_counts,
        context_parallel=request.context_parallel_cost,
    )


def _linear_fields(request: AutoPlanRequest) -> dict[str, float]:
    """:class:`PipelineShape`'s GatedDeltaNet fields for ``request.shape.linear_layers``,
    shaped like the attention (:meth:`GatedDeltaNetConfig.like_attention`)."""
    cost = request.shape
    if not cost.linear_layers:
        return {}
    layer, rows = GatedDeltaNetConfig.like_attention(cost), request.microbatch_size
    return {
        "linear_share": cost.linear_layers / cost.n_layers,
        "carry_bytes": layer.carry_bytes(request.dtype.itemsize) * rows,
        "carry_grad_bytes": layer.carry_bytes(4) * rows,
    }

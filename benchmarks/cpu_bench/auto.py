# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The planner on the benchmark's model: calibration, per-row estimates and the "auto" rows."""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.planner_probes.host_probes import CPU_HOST_PROBES
from torchtitan_seq1f1b.planner import (
    cached_calibration,
    CalibrationTarget,
    estimate,
    PipelineShape,
    PlanEstimate,
    rank_chain_length,
    recommend,
    Recommendation,
    TimeModel,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan
from benchmarks.cpu_bench.config import BenchConfig, BenchRow
from torchtitan_seq1f1b.tools.simulate import schedule_order, SimConfig

__all__ = ["auto_row", "calibrated_estimate", "calibrate_bench_model"]


def calibrate_bench_model(config: BenchConfig, refresh: bool = False) -> tuple[TimeModel, str]:
    """The bench model's time model on one CPU thread per rank, its ``pp`` ranks sharing the
    machine as they do in the run, and where it came from."""
    shape = config.model.cost()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = CalibrationTarget(
            shape=shape,
            seq_len=config.seq_len,
            microbatch_size=config.microbatch_size,
            attention_backend=config.model.attention_backend,
            contenders=config.pp,
            chained_blocks=rank_chain_length(shape.n_layers, config.pp),
        )
        model, path, cached = cached_calibration(target, refresh, CPU_HOST_PROBES)
    finally:
        torch.set_num_threads(threads)
    return model, f"{'cached in' if cached else 'calibrated, saved to'} {path}"


def _pipeline_shape(config: BenchConfig, schedule: str, microbatches: int) -> PipelineShape:
    probe = SimConfig(
        model=config.model.cost(),
        seq_len=config.seq_len,
        pp=config.pp,
        microbatches=microbatches,
        schedule=schedule,
        v=BenchRow(schedule, microbatches).spec.stages_per_rank,
        partition="uniform",
    )

    def order(num_segments: int):
        return schedule_order(replace(probe, segments=num_segments))

    return PipelineShape(tuple(probe.layers_per_stage()), order)


def calibrated_estimate(config: BenchConfig, row: BenchRow) -> PlanEstimate:
    """The planner's prediction for ``row`` (a schedule the simulator models)."""
    shape = _pipeline_shape(config, row.schedule, row.microbatches)
    plan = row.plan(config) if row.spec.segmented else SegmentPlan.uniform(config.seq_len, 1)
    return estimate(plan, row.partition or "uniform", shape, config.time_model)


def auto_row(
    config: BenchConfig, schedule: str, microbatches: int, budget_bytes: int | None
) -> tuple[BenchRow, Recommendation]:
    """The row the planner picks for ``schedule`` at ``microbatches``, with its table."""
    recommendation = recommend(
        _pipeline_shape(config, schedule, microbatches),
        config.time_model,
        config.model.cost(),
        config.seq_len,
        budget_bytes=budget_bytes,
    )
    best = recommendation.best
    row = BenchRow(schedule, microbatches, best.num_segments, best.partition, auto=True)
    return row, recommendation

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the ranks measured for a row, and the row's JSON record (``bench --json``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.planner_probes.compute_spans import ComputeSpan
from benchmarks.cpu_bench.config import BenchConfig, BenchRow

__all__ = ["RankRun", "StepTiming", "row_record"]


@dataclass(frozen=True)
class StepTiming:
    """One step on one rank; times are ``time.perf_counter`` seconds (one clock per machine).

    ``start`` is when the opening barrier released the rank, ``finish`` when
    its ``schedule.step`` returned, ``end`` when the closing barrier released it.
    """

    start: float
    finish: float
    end: float
    p2p_wait_seconds: float
    spans: list[ComputeSpan]

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def bubble_fraction(self) -> float:
        """Blocked on p2p, or done and waiting for the other ranks, over the step."""
        return (self.p2p_wait_seconds + self.end - self.finish) / self.seconds

    @property
    def compute_fraction(self) -> float:
        return sum(span.end - span.start for span in self.spans) / self.seconds


@dataclass(frozen=True)
class RankRun:
    """What one rank measured for one row; peaks in bytes."""

    steps: list[StepTiming]
    peak_bytes: int
    peak_saved_bytes: int
    peak_kv_bytes: int
    traffic_bytes: dict[str, int]
    """Bytes communicated over one step, per kind (:class:`~.traffic.TrafficCounter`)."""
    traffic_calls: dict[str, int]
    """Collectives, or p2p tensors, over that step, per kind."""
    first_step_seconds: float = 0.0
    """The first warm-up step (0 without one); with compiled blocks it compiles them."""


def _actions(row: BenchRow, runs: list[RankRun], step: int) -> list[dict]:
    """Compute spans of ``step`` on every rank, in seconds from its earliest start."""
    origin = min(run.steps[step].start for run in runs)
    k = row.segments
    actions = []
    for rank, run in enumerate(runs):
        for span in run.steps[step].spans:
            microbatch, segment = divmod(span.chunk, k)
            actions.append({
                "rank": rank,
                "stage": span.stage,
                "kind": span.kind,
                "microbatch": microbatch,
                "segment": segment,
                "start": span.start - origin,
                "end": span.end - origin,
            })
    return actions


def row_record(config: BenchConfig, row: BenchRow, runs: list[RankRun]) -> dict:
    """The record of ``row`` from every rank's run (``runs[rank]``), before comparisons."""
    step_times = [max(step.seconds for step in steps) for steps in zip(*(r.steps for r in runs))]
    median_step = step_times.index(statistics.median_low(step_times))
    bubbles = [statistics.median(step.bubble_fraction for step in r.steps) for r in runs]
    return {
        "schedule": row.schedule,
        "label": row.label(),
        "pp": config.pp,
        "cp": row.cp,
        "stages_per_rank": row.spec.stages_per_rank,
        "placement": row.spec.placement,
        "microbatches": row.microbatches,
        "segments": row.segments,
        "partition": row.partition,
        "auto": row.auto,
        "compiled": row.compiled,
        "first_step_s": max(run.first_step_seconds for run in runs),
        "segment_lengths": list(row.plan(config).lengths) if row.spec.segmented else None,
        "step_time_s": statistics.median(step_times),
        "step_times_s": step_times,
        "peak_activation_bytes": [run.peak_bytes for run in runs],
        "peak_saved_tensor_bytes": [run.peak_saved_bytes for run in runs],
        "peak_kv_store_bytes": [run.peak_kv_bytes for run in runs],
        "traffic_bytes": [run.traffic_bytes for run in runs],
        "traffic_calls": [run.traffic_calls for run in runs],
        "bubble_fraction": statistics.fmean(bubbles),
        "bubble_fraction_per_rank": bubbles,
        "compute_fraction_per_rank": [
            statistics.median(step.compute_fraction for step in r.steps) for r in runs
        ],
        "model": config.describe(),
        "steps": config.steps,
        "warmup_steps": config.warmup_steps,
        "actions": _actions(row, runs, median_step),
    }

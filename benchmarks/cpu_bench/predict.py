# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The simulator's prediction of each row, and every row's ratios to 1F1B."""

from __future__ import annotations

import statistics

from torchtitan_seq1f1b.tools.simulate import (
    activation_peaks,
    runtime_memory_model,
    SCHEDULES as SIMULATED_SCHEDULES,
    SimConfig,
    simulate,
    SimResult,
)
from benchmarks.cpu_bench.auto import calibrated_estimate
from benchmarks.cpu_bench.config import BenchConfig, BenchRow

__all__ = ["add_comparisons", "predict", "ratio_spread"]

BASELINE = "1F1B"


def predict(config: BenchConfig, row: BenchRow) -> SimResult | None:
    """The simulator's FLOP-priced result for ``row``, or None if it does not model it
    (nor context parallelism)."""
    if row.schedule not in SIMULATED_SCHEDULES or row.partition == "time" or row.cp > 1:
        return None
    try:
        sim_config = SimConfig(
            model=config.model.cost(),
            model_name="bench",
            seq_len=config.seq_len,
            pp=config.pp,
            microbatches=row.microbatches,
            segments=row.segments,
            schedule=row.schedule,
            v=row.spec.stages_per_rank,
            partition=row.partition or "uniform",
            memory=runtime_memory_model(config.microbatch_size),
        )
    except (NotImplementedError, ValueError):  # a layout the simulator does not model
        return None
    return simulate(sim_config)


def _add_calibrated(config: BenchConfig, rows: list[BenchRow], records: list[dict]) -> None:
    """The planner's calibrated step time, bubble and per-rank peaks, and their ratios to 1F1B."""
    estimates = [
        calibrated_estimate(config, row) if row.schedule in SIMULATED_SCHEDULES else None
        for row in rows
    ]
    baselines = {
        row.microbatches: found
        for row, found in zip(rows, estimates)
        if row.schedule == BASELINE and not row.compiled
    }
    for row, record, found in zip(rows, records, estimates):
        if found is None:
            continue
        record["calibrated"] = {
            "step_seconds": found.step_seconds,
            "bubble_fraction": found.bubble_fraction,
            "peak_bytes": list(found.peak_bytes),
        }
        base = baselines.get(row.microbatches)
        if base is not None:
            record["calibrated"]["step_time_ratio"] = found.step_seconds / base.step_seconds
            record["calibrated"]["peak_ratio"] = found.peak_bytes[0] / base.peak_bytes[0]


def ratio_spread(ratios: list[float]) -> float | None:
    """Half the interquartile range of a row's per-step ratios to 1F1B (None under two steps).

    How far one step's ratio strays from the row's median on this machine:
    rows whose ratios differ by less may swap on a rerun.
    """
    if len(ratios) < 2:
        return None
    first, _, third = statistics.quantiles(ratios, n=4, method="inclusive")
    return (third - first) / 2


def add_comparisons(config: BenchConfig, rows: list[BenchRow], records: list[dict]) -> None:
    """Ratios against eager 1F1B (same m), measured and simulated, added to each record."""
    if config.time_model is not None:
        _add_calibrated(config, rows, records)
    baselines = {
        row.microbatches: (record, predict(config, row))
        for row, record in zip(rows, records)
        if row.schedule == BASELINE and not row.compiled
    }
    for row, record in zip(rows, records):
        predicted = predict(config, row)
        record["predicted"] = None if predicted is None else {
            "makespan": predicted.makespan,
            "bubble_fraction": predicted.bubble_fraction,
            "peak_activation_bytes": activation_peaks(predicted),
        }
        base_record, base_predicted = baselines.get(row.microbatches, (None, None))
        if base_record is None:
            continue
        # Paired by round: both steps ran within one pass over the rows.
        record["step_time_ratios"] = [
            mine / base for mine, base in zip(record["step_times_s"], base_record["step_times_s"])
        ]
        record["step_time_ratio"] = statistics.median(record["step_time_ratios"])
        record["step_time_ratio_spread"] = ratio_spread(record["step_time_ratios"])
        record["peak_activation_ratio"] = (
            record["peak_activation_bytes"][0] / base_record["peak_activation_bytes"][0]
        )
        if predicted is not None and base_predicted is not None:
            record["predicted"]["step_time_ratio"] = predicted.makespan / base_predicted.makespan
            record["predicted"]["peak_activation_ratio"] = (
                activation_peaks(predicted)[0] / activation_peaks(base_predicted)[0]
            )

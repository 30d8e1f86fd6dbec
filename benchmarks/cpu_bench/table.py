# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The benchmark's printed table: measured values next to the simulator's."""

from __future__ import annotations

import statistics

from benchmarks.cpu_bench.config import BenchConfig
from benchmarks.cpu_bench.predict import BASELINE

__all__ = ["noise_summary", "print_table"]

MIB = 2**20


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def noise_summary(records: list[dict]) -> str | None:
    """One line on how far step ratios stray within this run (None without two timed steps)."""
    spreads = [
        r["step_time_ratio_spread"]
        for r in records
        if r["schedule"] != BASELINE and r.get("step_time_ratio_spread") is not None
    ]
    if not spreads:
        return None
    return (
        f"noise: a row's per-step ratios to 1F1B spread +-{statistics.median(spreads):.1%} "
        f"around its median (half the interquartile range; median over rows, widest "
        f"+-{max(spreads):.1%}); rows whose ratios differ by less may swap on a rerun"
    )


def print_table(config: BenchConfig, records: list[dict]) -> None:
    model = config.describe()
    print(
        f"model: dim={model['dim']} layers={model['n_layers']} heads={model['n_heads']} "
        f"kv_heads={model['n_kv_heads']} ffn={model['ffn_hidden_dim']} "
        f"vocab={model['vocab_size']} ({model['parameters'] / 1e6:.1f}M params, fp32) "
        f"seq_len={config.seq_len} microbatch_size={config.microbatch_size} pp={config.pp}; "
        f"median of {config.steps} steps after {config.warmup_steps} warm-up"
    )
    print(
        "ratios are against torch Schedule1F1B with the same m; sim = simulator (FLOP-priced), "
        "cal = simulator with the calibrated time model"
    )
    header = (
        f"{'schedule':<36} {'m':>2} {'step s':>7} {'x1F1B':>6} {'sim':>6} {'cal':>6} "
        f"{'bubble':>6} {'sim':>6} {'r0 act MiB':>10} {'x1F1B':>6} {'sim':>6}  act MiB per rank"
    )
    print(header)
    print("-" * len(header))
    for rec in records:
        predicted = rec.get("predicted") or {}
        calibrated = rec.get("calibrated") or {}
        peaks = " ".join(f"{b / MIB:7.1f}" for b in rec["peak_activation_bytes"])
        print(
            f"{rec['label']:<36} {rec['microbatches']:>2} {rec['step_time_s']:>7.3f} "
            f"{_fmt(rec.get('step_time_ratio'), '6.3f'):>6} "
            f"{_fmt(predicted.get('step_time_ratio'), '6.3f'):>6} "
            f"{_fmt(calibrated.get('step_time_ratio'), '6.3f'):>6} "
            f"{rec['bubble_fraction']:>6.3f} {_fmt(predicted.get('bubble_fraction'), '6.3f'):>6} "
            f"{rec['peak_activation_bytes'][0] / MIB:>10.1f} "
            f"{_fmt(rec.get('peak_activation_ratio'), '6.3f'):>6} "
            f"{_fmt(predicted.get('peak_activation_ratio'), '6.3f'):>6}  {peaks}"
        )
    summary = noise_summary(records)
    if summary:
        print(summary)

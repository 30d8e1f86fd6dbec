# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The benchmark's printed table: measured values next to the simulator's."""

from __future__ import annotations

import statistics

from benchmarks.cpu_bench.config import BenchConfig
from benchmarks.cpu_bench.predict import BASELINE
from benchmarks.cpu_bench.traffic import TRAFFIC_KINDS

__all__ = ["noise_summary", "print_context_table", "print_table"]

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


def _model_line(config: BenchConfig) -> str:
    model = config.describe()
    return (
        f"model: dim={model['dim']} layers={model['n_layers']} heads={model['n_heads']} "
        f"kv_heads={model['n_kv_heads']} ffn={model['ffn_hidden_dim']} "
        f"vocab={model['vocab_size']} ({model['parameters'] / 1e6:.1f}M params, fp32) "
        f"seq_len={config.seq_len} microbatch_size={config.microbatch_size} pp={config.pp}"
    )


def print_table(config: BenchConfig, records: list[dict]) -> None:
    print(
        f"{_model_line(config)}; median of {config.steps} steps after "
        f"{config.warmup_steps} warm-up"
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


def _context_label(record: dict) -> str:
    if record["schedule"] == BASELINE:
        return "1F1B (torch)"
    if record["segments"] == 1:
        return "1F1B order (Seq1F1B k=1)"
    return f"Seq1F1B k={record['segments']} {record['partition']}"


def print_context_table(config: BenchConfig, records: list[dict]) -> None:
    """Rank 0's peaks and bytes per step, with and without context parallelism."""
    print(f"{_model_line(config)}; rank = pp_rank * cp + cp_rank; rank 0 over one step")
    print(
        "with CP, 1F1B runs as Seq1F1B k=1 (its order): torch's Schedule1F1B cannot give CP "
        "ranks their share of each segment; AG/RS = K/V all-gather/dK,dV reduce-scatter, "
        "bytes each rank sends (= receives); PP = pipeline sends/receives; MiB"
    )
    header = (
        f"{'schedule':<26} {'m':>2} {'cp':>2} {'act MiB':>8} {'x1F1B':>6} {'K/V MiB':>8} "
        f"{'AG':>7} {'RS':>7} {'PP send':>7} {'PP recv':>7}"
    )
    print(header)
    print("-" * len(header))
    for rec in records:
        traffic = rec["traffic_bytes"][0]
        print(
            f"{_context_label(rec):<26} {rec['microbatches']:>2} {rec['cp']:>2} "
            f"{rec['peak_activation_bytes'][0] / MIB:>8.2f} "
            f"{_fmt(rec.get('peak_activation_ratio'), '6.3f'):>6} "
            f"{rec['peak_kv_store_bytes'][0] / MIB:>8.2f} "
            + " ".join(f"{traffic[kind] / MIB:>7.2f}" for kind in TRAFFIC_KINDS)
        )

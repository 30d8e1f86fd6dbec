# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Sweep chart: rank-0 activations, bubble and step time against the segment count k.

Simulated curves for uniform and balanced partitions with the closed forms of
the design notes, plus measured points when given bench records.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from torchtitan_seq1f1b.segmenting import TransformerCost
from torchtitan_seq1f1b.tools.simulate import (
    activation_peaks,
    runtime_memory_model,
    SimConfig,
    simulate,
    SimResult,
)

__all__ = ["plot_sweep"]

_PARTITION_STYLES = {"uniform": ("o", "tab:blue"), "balanced": ("s", "tab:orange")}


def _sim(model: TransformerCost, model_name: str, seq_len: int, pp: int, m: int,
         schedule: str, k: int = 1, partition: str = "uniform") -> SimResult:
    return simulate(SimConfig(
        model=model, model_name=model_name, seq_len=seq_len, pp=pp, microbatches=m, segments=k, schedule=schedule,
        partition=partition, memory=runtime_memory_model(),
    ))


def plot_sweep(
    model: TransformerCost,
    model_name: str,
    seq_len: int,
    pp: int,
    microbatches: int,
    path: str,
    segments: Sequence[int] = (1, 2, 4, 8, 16),
    schedule: str = "Seq1F1B",
    bench_records: Sequence[dict] = (),
) -> None:
    """Rank-0 activations, bubble and step time vs k, simulated (and measured) into ``path``."""
    baseline = _sim(model, model_name, seq_len, pp, microbatches, "1F1B")
    fig, (mem_ax, bubble_ax, time_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    simulated = {
        partition: [_sim(model, model_name, seq_len, pp, microbatches, schedule, k, partition) for k in segments]
        for partition in _PARTITION_STYLES
    }
    for partition, (marker, color) in _PARTITION_STYLES.items():
        results = simulated[partition]
        style = dict(marker=marker, color=color, label=f"simulated, {partition}")
        mem_ax.plot(segments, [activation_peaks(r)[0] / activation_peaks(baseline)[0]
                               for r in results], **style)
        bubble_ax.plot(segments, [r.bubble_fraction for r in results], **style)
        time_ax.plot(segments, [r.makespan / baseline.makespan for r in results], **style)
    # Closed forms with equal-cost units, where the design notes give one.
    analytic = [r.analytic_bubble_fraction for r in simulated["uniform"]]
    if None not in analytic:
        bubble_ax.plot(segments, analytic, "k:", label="closed form, equal units")
    if schedule == "Seq1F1B":
        fine = [k / 4 for k in range(4, 4 * max(segments) + 1)]
        mem_ax.plot(fine, [(pp + k - 1) / (k * pp) for k in fine], "k:",
                    label="(p+k-1)/(k p), equal units, no K/V")

    measured = [
        r for r in bench_records
        if r["schedule"] == schedule and r["pp"] == pp and r["microbatches"] == microbatches
    ]
    for partition, (marker, color) in _PARTITION_STYLES.items():
        # k = 1 has one partition; it is drawn with the uniform points.
        points = sorted(
            (r for r in measured
             if (r["partition"] == partition if r["segments"] > 1 else partition == "uniform")),
            key=lambda r: r["segments"],
        )
        if not points:
            continue
        ks = [r["segments"] for r in points]
        style = dict(marker=marker, color=color, linestyle="none", markersize=11,
                     markerfacecolor="none", markeredgewidth=2, label=f"measured, {partition}")
        if all("peak_activation_ratio" in r for r in points):
            mem_ax.plot(ks, [r["peak_activation_ratio"] for r in points], **style)
            time_ax.plot(ks, [r["step_time_ratio"] for r in points], **style)
        bubble_ax.plot(ks, [r["bubble_fraction"] for r in points], **style)

    for ax, ylabel in (
        (mem_ax, "rank-0 peak activations / 1F1B"),
        (bubble_ax, "bubble fraction"),
        (time_ax, "step time / 1F1B"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(segments), [str(k) for k in segments])
        ax.set_xlabel(f"segments k ({schedule})")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    mem_ax.axhline(1.0, color="grey", linewidth=0.8)
    time_ax.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(
        f"{schedule} vs k: p={pp} m={microbatches}, model {model_name} "
        f"(L{model.n_layers} H{model.dim} h{model.n_heads} g{model.n_kv_heads}), S={seq_len}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline timelines and memory/bubble-vs-k charts as PNG files.

Run ``python -m torchtitan_seq1f1b.plot --help``. Two charts:

``timeline``
    Ranks x time, one box per compute action: colour = microbatch, lighter =
    earlier segment, and the kind by hatching and label (``F0.1`` forward of
    microbatch 0 segment 1; B full backward, I input-gradient, W
    weight-gradient; a stage prefix such as ``2F0.1`` when a rank holds
    several stages). The actions come from the simulator (the exact orders the
    schedules run, timed by FLOPs) or from a real run recorded by
    ``python -m torchtitan_seq1f1b.bench --json``.
``sweep``
    Rank-0 peak activations (relative to 1F1B), bubble fraction and step time
    (relative to 1F1B) against the segment count k: simulated curves for
    uniform and balanced partitions and the closed forms of the design notes,
    plus measured points when given a bench JSON.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI machines

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from torchtitan_seq1f1b.bench import FULL_PRESET, memory_model  # noqa: E402
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformerArgs  # noqa: E402
from torchtitan_seq1f1b.orders import replay  # noqa: E402
from torchtitan_seq1f1b.segmenting import TransformerCost  # noqa: E402
from torchtitan_seq1f1b.tools.model_shapes import MODEL_PRESETS  # noqa: E402
from torchtitan_seq1f1b.tools.simulate import (  # noqa: E402
    unit_times as _unit_times,
    SCHEDULE_SPECS,
    schedule_order,
    SimConfig,
    simulate,
)

__all__ = ["Action", "main", "measured_actions", "plot_sweep", "plot_timeline", "simulated_actions"]

_HATCHES = {"F": "", "B": "///", "I": "\\\\\\", "W": "..."}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
_SEGMENTED = [name for name, spec in SCHEDULE_SPECS.items() if spec.segmented]
_PARTITION_STYLES = {"uniform": ("o", "tab:blue"), "balanced": ("s", "tab:orange")}


@dataclass(frozen=True)
class Action:
    """One compute box of a timeline; times in the source's unit."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    segment: int
    start: float
    end: float


@dataclass(frozen=True)
class TimelineData:
    """Everything :func:`plot_timeline` draws, and its caption."""

    actions: list[Action]
    title: str
    time_unit: str
    num_segments: int


def simulated_actions(config: SimConfig) -> TimelineData:
    """The simulator's timeline of ``config``: its real order, timed by FLOPs."""
    plan = config.plan()
    # simulate() times actions this way but keeps only the totals, not the spans.
    times = _unit_times(config, plan)
    share = [n * config.pp / config.model.n_layers for n in config.layers_per_stage()]
    order = schedule_order(config)
    timeline = replay(
        order, lambda a: times[a.kind][a.segment] * share[a.stage], config.p2p_latency
    )
    actions = [
        Action(rank, a.stage, a.kind, a.microbatch, a.segment, *timeline.spans[a])
        for rank, rank_actions in order.items()
        for a in rank_actions
    ]
    k = plan.num_segments
    title = (
        f"simulated {config.schedule}: p={config.pp} v={config.v} m={config.microbatches} "
        f"k={k}{f' {config.partition}' if k > 1 else ''}, model {config.model_name} "
        f"S={config.seq_len}; bubble {timeline.bubble_fraction:.3f}"
    )
    return TimelineData(actions, title, "time (forwards of one microbatch on one rank)", k)


def measured_actions(record: dict) -> TimelineData:
    """The median step of a bench record (``bench --json``), in seconds."""
    actions = [Action(**{f.name: a[f.name] for f in fields(Action)}) for a in record["actions"]]
    if not actions:
        raise ValueError(f"bench record {record['label']!r} has no recorded actions")
    title = (
        f"measured {record['label']}: p={record['pp']} m={record['microbatches']}; "
        f"step {record['step_time_s']:.3f}s, bubble {record['bubble_fraction']:.3f} "
        f"(median step, {record['model']['dim']}-dim {record['model']['n_layers']}-layer model, "
        f"S={record['model']['seq_len']})"
    )
    return TimelineData(actions, title, "time (s) from the step's start", record["segments"])


def _shade(color, segment: int, num_segments: int) -> tuple[float, float, float]:
    """Earlier segments lighter, the last at the base colour."""
    if num_segments == 1:
        return to_rgb(color)
    hue, lightness, saturation = colorsys.rgb_to_hls(*to_rgb(color))
    lighten = 0.55 * (num_segments - 1 - segment) / (num_segments - 1)
    return colorsys.hls_to_rgb(hue, lightness + (1 - lightness) * lighten, saturation)


def _label(action: Action, num_segments: int, multi_stage: bool) -> str:
    unit = f"{action.microbatch}.{action.segment}" if num_segments > 1 else f"{action.microbatch}"
    return f"{action.stage if multi_stage else ''}{action.kind}{unit}"


def plot_timeline(data: TimelineData, path: str) -> None:
    """Draw ``data`` as ranks x time boxes into the PNG ``path``."""
    actions = data.actions
    ranks = sorted({a.rank for a in actions})
    multi_stage = len({a.stage for a in actions}) > len(ranks)
    microbatches = sorted({a.microbatch for a in actions})
    start = min(a.start for a in actions)
    makespan = max(a.end for a in actions) - start
    palette = plt.get_cmap("tab10").colors
    busiest = max(sum(a.rank == r for a in actions) for r in ranks)
    width = min(max(12.0, 0.6 * busiest), 30.0)
    # Long schedules get taller rows too, so the image keeps a viewable shape.
    fig, ax = plt.subplots(figsize=(width, max(3.0, 1.2 + 0.9 * len(ranks), width / 5)))
    for a in actions:
        color = _shade(palette[a.microbatch % len(palette)], a.segment, data.num_segments)
        ax.add_patch(Rectangle(
            (a.start - start, a.rank - 0.4), a.end - a.start, 0.8,
            facecolor=color, edgecolor="black", linewidth=0.6, hatch=_HATCHES[a.kind],
        ))
        # Labels only where they fit: the axis spans ~80% of the figure, and a
        # 7-point character is ~0.06 inch wide.
        label = _label(a, data.num_segments, multi_stage)
        if (a.end - a.start) / makespan * width * 0.8 > (len(label) + 0.5) * 0.06:
            ax.text(
                (a.start + a.end) / 2 - start, a.rank, label, ha="center", va="center",
                fontsize=7, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                  "alpha": 0.7},
            )
    ax.set_xlim(0, makespan * 1.01)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_xlabel(data.time_unit)
    ax.set_title(data.title, fontsize=9)
    kinds = [k for k in "FBIW" if any(a.kind == k for a in actions)]
    handles = [
        Patch(facecolor="white", edgecolor="black", hatch=_HATCHES[k], label=_KIND_NAMES[k])
        for k in kinds
    ] + [
        Patch(facecolor=palette[i % len(palette)], edgecolor="black", label=f"microbatch {i}")
        for i in microbatches[:10]
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              title="lighter = earlier segment" if data.num_segments > 1 else None,
              title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- memory and bubble against k -------------------------------------------------


def _sim(model: TransformerCost, model_name: str, seq_len: int, pp: int, m: int,
         schedule: str, k: int = 1, partition: str = "uniform"):
    return simulate(SimConfig(
        model=model, model_name=model_name, seq_len=seq_len, pp=pp, microbatches=m, segments=k, schedule=schedule,
        partition=partition, memory=memory_model(),
    ))


def _rank0_activations(result) -> int:
    rank0 = result.ranks[0]
    return rank0.peak_memory_bytes - rank0.model_state_bytes


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
        mem_ax.plot(segments, [_rank0_activations(r) / _rank0_activations(baseline)
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


# ---- command line -----------------------------------------------------------------


def _bench_model(record: dict) -> TransformerCost:
    names = {f.name for f in fields(TinyTransformerArgs)}
    return TinyTransformerArgs(**{k: v for k, v in record["model"].items() if k in names}).cost()


def _load_records(parser: argparse.ArgumentParser, path: str) -> list[dict]:
    try:
        with open(path) as handle:
            records = json.load(handle)
    except (OSError, ValueError) as error:
        parser.error(f"cannot read --bench {path}: {error}")
    if not isinstance(records, list) or not records:
        parser.error(f"--bench {path} is not a non-empty JSON list of bench records")
    return records


def _pick_record(parser: argparse.ArgumentParser, records: list[dict], args) -> dict:
    matches = [
        r for r in records
        if r["schedule"] == args.schedule
        and (args.microbatches is None or r["microbatches"] == args.microbatches)
        and (args.segments is None or r["segments"] == args.segments)
        and (args.partition is None or r["segments"] == 1 or r["partition"] == args.partition)
    ]
    if not matches:
        labels = sorted({f"{r['label']} m={r['microbatches']}" for r in records})
        parser.error(
            f"no record for --schedule {args.schedule} with the given -m/-k/--partition in "
            f"--bench; it holds: {', '.join(labels)}"
        )
    return matches[0]


def _model_from_args(args) -> tuple[TransformerCost, int]:
    if args.model == "bench":
        return FULL_PRESET.model.cost(), args.seq_len or FULL_PRESET.seq_len
    if args.seq_len is None:
        raise ValueError(f"--model {args.model} needs --seq-len")
    return MODEL_PRESETS[args.model], args.seq_len


def _describe(model: TransformerCost, model_name: str, seq_len: int) -> str:
    return (
        f"model {model_name} (dim {model.dim}, {model.n_layers} layers, {model.n_heads} "
        f"heads, {model.n_kv_heads} K/V heads), seq_len {seq_len}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.plot",
        description="Draw pipeline timelines and memory/bubble-vs-k charts as PNG files.",
    )
    sub = parser.add_subparsers(dest="chart", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output", "-o", required=True, help="PNG file to write")
    common.add_argument("--bench", metavar="JSON", help="records of bench --json")
    common.add_argument("--model", default="bench", choices=["bench", *sorted(MODEL_PRESETS)],
                        help="simulated model: a preset, or (default) the CPU benchmark's "
                             "model (dim 256, 8 layers, 8 heads, 2 K/V heads)")
    common.add_argument("--seq-len", type=int,
                        help=f"tokens per sequence (default {FULL_PRESET.seq_len} for "
                             "--model bench; required for a preset)")
    common.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    common.add_argument("--microbatches", "-m", type=int, help="microbatches (default 2)")

    timeline = sub.add_parser(
        "timeline", parents=[common],
        help="ranks x time boxes of one schedule, simulated or from --bench",
    )
    timeline.add_argument("--schedule", default="Seq1F1B", choices=list(SCHEDULE_SPECS))
    timeline.add_argument("--segments", "-k", type=int, help="segments (default 4 if segmented)")
    timeline.add_argument("--partition", choices=("uniform", "balanced"))
    timeline.add_argument("--v", type=int, help="stages per rank (default: the schedule's)")

    sweep = sub.add_parser(
        "sweep", parents=[common],
        help="rank-0 activations, bubble and step time vs k (simulated; measured with --bench)",
    )
    sweep.add_argument("--schedule", default="Seq1F1B", choices=_SEGMENTED)
    sweep.add_argument("--segments", "-k", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    records = _load_records(parser, args.bench) if args.bench else []
    try:
        if records:
            model, seq_len = _bench_model(records[0]), records[0]["model"]["seq_len"]
            model_name = "bench"
            pp = records[0]["pp"]
        else:
            (model, seq_len), pp = _model_from_args(args), args.pp
            model_name = args.model
        print(f"{'measured' if records else 'simulated'}: {_describe(model, model_name, seq_len)}, "
              f"pp {pp}, m {args.microbatches or 2}")
        if args.chart == "timeline":
            if records:
                data = measured_actions(_pick_record(parser, records, args))
            else:
                config = SimConfig(
                    model=model, model_name=model_name, seq_len=seq_len, pp=pp,
                    microbatches=args.microbatches or 2,
                    segments=args.segments or 4, schedule=args.schedule, v=args.v,
                    partition=args.partition or "balanced", memory=memory_model(),
                )
                print(f"{config.schedule}, k {config.num_segments} ({config.partition}), "
                      f"v {config.v}")
                data = simulated_actions(config)
            plot_timeline(data, args.output)
        else:
            plot_sweep(model, model_name, seq_len, pp, args.microbatches or 2, args.output,
                       segments=sorted(set(args.segments)), schedule=args.schedule,
                       bench_records=records)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plot``: the ``timeline`` and ``sweep`` subcommands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import fields

from torchtitan_seq1f1b.examples.tiny_transformer import BENCH_MODEL, BENCH_SEQ_LEN, TinyTransformerArgs
from torchtitan_seq1f1b.segmenting import TransformerCost
from torchtitan_seq1f1b.tools.simulate import runtime_memory_model, SCHEDULE_SPECS, SimConfig
from torchtitan_seq1f1b.tools.model_shapes import MODEL_PRESETS
from torchtitan_seq1f1b.tools.plot.sweep import plot_sweep
from torchtitan_seq1f1b.tools.plot.timeline import measured_actions, plot_timeline, simulated_actions

__all__ = ["main"]

_SEGMENTED = [name for name, spec in SCHEDULE_SPECS.items() if spec.segmented]


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
        return BENCH_MODEL.cost(), args.seq_len or BENCH_SEQ_LEN
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
                        help=f"tokens per sequence (default {BENCH_SEQ_LEN} for "
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
                    partition=args.partition or "balanced", memory=runtime_memory_model(),
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

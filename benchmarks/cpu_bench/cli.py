# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m benchmarks.cpu_bench``: options, their checks, the run and its output."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

from torchtitan_seq1f1b.planner import GIB, PARTITIONS
from benchmarks.cpu_bench.auto import auto_row, calibrate_bench_model
from torchtitan_seq1f1b.tools.simulate import (
    number_at_least,
    positive_float,
    positive_int,
    write_json,
)
from benchmarks.cpu_bench.config import (
    BenchConfig,
    BenchRow,
    FULL_PRESET,
    plan_context_rows,
    plan_rows,
    QUICK_PRESET,
)
from benchmarks.cpu_bench.runner import run_bench
from benchmarks.cpu_bench.schedules import SCHEDULES
from benchmarks.cpu_bench.table import print_context_table, print_table

__all__ = ["main"]

_non_negative_int = number_at_least(int, 0, "an integer >= 0")
_context_degree = number_at_least(int, 2, "an integer >= 2")
# Options that choose rows: --cp runs its own.
_NOT_WITH_CP = ("schedules", "partitions", "auto", "compile")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_bench",
        description=(
            "Train a small causal transformer with torch's pipeline schedules and Seq1F1B on "
            "local gloo ranks (one CPU thread each); report step time, bubble and measured "
            "activation memory against torch's 1F1B and the simulator's prediction."
        ),
    )
    parser.add_argument("--quick", action="store_true",
                        help="small model, m = pp, k in {1, 4}, 2 steps: a smoke run of a few minutes")
    run = parser.add_argument_group("layout and rows")
    run.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (default 2)")
    run.add_argument("--microbatches", "-m", type=positive_int, nargs="+",
                     help="microbatch counts (default: pp and 2*pp; --quick: pp)")
    run.add_argument("--segments", "-k", type=positive_int, nargs="+",
                     help="Seq1F1B segment counts (default: 1 2 4 8 for Seq1F1B, 1 2 4 for "
                          "its interleaved and zero-bubble variants; --quick: 1 4)")
    run.add_argument("--partitions", nargs="+", choices=PARTITIONS,
                     help="segment lengths for k > 1: equal, FLOP-balanced, or balanced by "
                          "calibrated time (default uniform and balanced; --quick: balanced)")
    run.add_argument("--auto", action="store_true",
                     help="add, per Seq1F1B schedule and m, the row the planner picks "
                          "(k and partition with the least predicted step time)")
    run.add_argument("--memory-budget-gib", type=positive_float, metavar="GIB",
                     help="with --auto: activations + K/V bytes per rank the pick must fit")
    run.add_argument("--recalibrate", action="store_true",
                     help="time the blocks and head again even if this machine's calibration "
                          "is cached (e.g. it was taken while other work ran)")
    run.add_argument("--no-calibrate", action="store_true",
                     help="skip timing the model's blocks and head on this machine (then no "
                          "calibrated predictions, no --auto, no time partition)")
    run.add_argument("--schedules", nargs="+", choices=list(SCHEDULES),
                     metavar="NAME", help=f"rows to run (default all: {', '.join(SCHEDULES)})")
    run.add_argument("--cp", type=_context_degree, metavar="C",
                     help="instead of the schedule rows, context parallelism: 1F1B and uniform "
                          "Seq1F1B on pp ranks against Seq1F1B on C*pp ranks (CP=C x PP), "
                          "k = 1 standing in for 1F1B; rank 0's activation and K/V peaks and "
                          "bytes communicated per step (no calibration)")
    run.add_argument("--compile", action="store_true",
                     help="also run every row with compiled blocks, in the same run")
    run.add_argument("--steps", type=positive_int, help="timed steps per row (default 5; --quick: 2)")
    run.add_argument("--warmup-steps", type=_non_negative_int,
                     help="untimed steps per row first (default 1)")
    model = parser.add_argument_group("model (default: the full or --quick size)")
    for flag, help_text in (
        ("--dim", "model width"),
        ("--layers", "transformer blocks"),
        ("--heads", "query heads"),
        ("--kv-heads", "K/V heads"),
        ("--ffn-dim", "MLP hidden width"),
        ("--vocab", "vocabulary size"),
        ("--seq-len", "tokens per sequence"),
        ("--microbatch-size", "sequences per microbatch (default 1)"),
    ):
        model.add_argument(flag, type=positive_int, help=help_text)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    out.add_argument("--timeout", type=float, default=3600,
                     help="seconds before the ranks are declared hung (default 3600)")
    return parser


def _config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[BenchConfig, list[BenchRow]]:
    """Resolve defaults and reject what cannot run, before any process starts."""
    preset = QUICK_PRESET if args.quick else FULL_PRESET
    base = preset.model
    model = dataclasses.replace(
        base,
        dim=args.dim or base.dim,
        n_layers=args.layers or base.n_layers,
        n_heads=args.heads or base.n_heads,
        n_kv_heads=args.kv_heads or base.n_kv_heads,
        ffn_hidden_dim=args.ffn_dim or base.ffn_hidden_dim,
        vocab_size=args.vocab or base.vocab_size,
    )
    try:
        model.cost()
    except ValueError as error:
        parser.error(f"{error} (model options --dim/--heads/--kv-heads)")
    if (model.dim // model.n_heads) % 2:
        parser.error(
            f"--dim {model.dim} / --heads {model.n_heads} gives an odd head dim; "
            "RoPE needs an even one"
        )
    pp = args.pp
    if pp < 2:
        parser.error(f"--pp {pp}: a pipeline needs at least 2 ranks; use --pp 2 or more")
    seq_len = args.seq_len or preset.seq_len
    microbatches = args.microbatches or [pp * n for n in preset.microbatches_per_pp]
    segments = args.segments or preset.segments
    schedules = args.schedules or list(SCHEDULES)
    if args.cp:
        chosen = [f"--{name}" for name in _NOT_WITH_CP if getattr(args, name)]
        if chosen:
            parser.error(
                f"--cp runs its own rows (1F1B and uniform Seq1F1B); leave out {' '.join(chosen)}"
            )
        schedules = ["1F1B", "Seq1F1B"]
        segments = segments or SCHEDULES["Seq1F1B"].default_segments
        for k in segments:
            # Equal segments that CP can cut into 2c pieces: the same plan with and without CP.
            if seq_len % (2 * args.cp * k):
                parser.error(
                    f"--seq-len {seq_len} does not split into {k} segments of a multiple of "
                    f"2 * cp = {2 * args.cp} tokens; use --seq-len a multiple of {2 * args.cp * k}"
                )
    for k in segments or ():
        if seq_len % k:
            divisors = " ".join(str(d) for d in range(1, 17) if seq_len % d == 0)
            parser.error(
                f"--segments {k} does not divide --seq-len {seq_len}; pick segment counts "
                f"that divide the sequence length (up to 16: {divisors})"
            )
    for name in schedules:
        spec = SCHEDULES[name]
        stages = pp * spec.stages_per_rank
        if model.n_layers % stages:
            parser.error(
                f"--layers {model.n_layers} does not split into the {stages} equal stages "
                f"{name} needs with --pp {pp} ({spec.stages_per_rank} per rank); use --layers "
                f"a multiple of {stages}, another --pp, or leave {name} out of --schedules"
            )
        for m in microbatches:
            reason = spec.constraint(pp, m) if spec.constraint else None
            if reason:
                parser.error(
                    f"{name} {reason} with --pp {pp} --microbatches {m}; pass --microbatches "
                    f"values that fit, or leave {name} out of --schedules"
                )
    config = BenchConfig(
        model=model,
        seq_len=seq_len,
        pp=pp,
        microbatch_size=args.microbatch_size or 1,
        steps=args.steps or preset.steps,
        warmup_steps=preset.warmup_steps if args.warmup_steps is None else args.warmup_steps,
    )
    partitions = args.partitions or preset.partitions
    if args.no_calibrate and (args.auto or "time" in partitions):
        parser.error("--auto and --partitions time need the calibration; drop --no-calibrate")
    if args.memory_budget_gib is not None and not args.auto:
        parser.error("--memory-budget-gib bounds the --auto pick; add --auto")
    if args.cp:
        return config, plan_context_rows(args.cp, microbatches, segments)
    compiled = (False, True) if args.compile else (False,)
    return config, plan_rows(schedules, microbatches, segments, partitions, compiled)


def _add_planner(args: argparse.Namespace, config: BenchConfig, rows: list[BenchRow]):
    """Calibrate (or read the cache), then append the planner's pick per schedule and m."""
    time_model, source = calibrate_bench_model(config, refresh=args.recalibrate)
    print(f"time model: {source}; {time_model.describe()}", flush=True)
    config = dataclasses.replace(config, time_model=time_model)
    if not args.auto:
        return config, rows
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * GIB)
    picked = []
    for m in dict.fromkeys(row.microbatches for row in rows):
        for name in dict.fromkeys(row.schedule for row in rows):
            if not SCHEDULES[name].segmented:
                continue
            row, recommendation = auto_row(config, name, m, budget)
            print(f"planner, {name} m={m}:\n{recommendation.table()}", flush=True)
            picked.append(row)
    return config, rows + picked


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config, rows = _config_from_args(parser, args)
    if not (args.no_calibrate or args.cp):
        config, rows = _add_planner(args, config, rows)
    ranks = " and ".join(str(config.pp * cp) for cp in dict.fromkeys(row.cp for row in rows))
    print(f"running {len(rows)} rows on {ranks} gloo ranks...", flush=True)
    started = time.perf_counter()
    records = run_bench(config, rows, timeout=args.timeout)
    (print_context_table if args.cp else print_table)(config, records)
    print(f"total wall time {time.perf_counter() - started:.1f}s")
    if args.json:
        write_json(parser, args.json, records)
    return 0

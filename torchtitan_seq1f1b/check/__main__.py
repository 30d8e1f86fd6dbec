# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.check [--device cuda|cpu] [--checks ...] [--json PATH]``.

Prints a pass/fail/skip table and exits 1 if any check failed. Without CUDA
and without ``--device cpu`` it says so, lists what it would run, and exits 0.
``--perf`` instead measures a stage's units and predicts a step
(:mod:`torchtitan_seq1f1b.check.perf`). ``--gpu-report OUTDIR [--budget-s S]``
runs both, and a compiled block, within a time budget, into OUTDIR
(:mod:`torchtitan_seq1f1b.check.report`).
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from torchtitan_seq1f1b.check import format_table, Result
from torchtitan_seq1f1b.check.distributed import pipelined_results, torchtitan_results
from torchtitan_seq1f1b.check.kernels import kernel_results
from torchtitan_seq1f1b.check.perf import CPU_SHAPE, format_perf, GPU_SHAPE, perf_results
from torchtitan_seq1f1b.check.report import gpu_report
from torchtitan_seq1f1b.check.stack import stack_results

CHECKS = {
    "kernels": (
        kernel_results,
        "every attention backend that runs here (flash-attn, torch's flash kernel, the exact path) on a segment "
        "with a prefix, bf16, GQA, head dims 64 and 128, forward and backward, against "
        "exact float64 attention; through autograd and as the op compiled blocks call; "
        "GatedDeltaNet's fla recurrence in a segmented bf16 layer against the exact path in float64",
    ),
    "stack": (
        stack_results,
        "a llama3-shaped stack run segment by segment (backward on autograd's device "
        "thread) under every activation checkpointing mode, float32 and bf16, against "
        "unsplit training; peak memory per segment",
    ),
    "pipelined": (
        pipelined_results,
        "the four schedules x checkpointing modes on 2 GPUs over NCCL, float64, "
        "against unsplit training; Seq1F1B and InterleavedSeq1F1B also with compiled blocks; "
        "the four schedules with and without checkpointing under CP = 2 x PP = 2 on 4 GPUs",
    ),
    "torchtitan": (
        torchtitan_results,
        "a short torchtitan job, Seq1F1B PP=2 against one process from a seed checkpoint",
    ),
}
# On CPU the multi-process checks duplicate the test suite; run them with --checks.
DEFAULT_CHECKS = {"cuda": tuple(CHECKS), "cpu": ("kernels", "stack")}
# --gpu-report's: within 8 minutes on one H100, imports and the last row's overrun included.
DEFAULT_BUDGET_S = 420.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.check",
        description="Check Seq1F1B's kernels, segmented training and pipelines on this machine.",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"),
        help="default: cuda if available; cpu runs what can run without a GPU",
    )
    parser.add_argument(
        "--checks", type=lambda s: tuple(s.split(",")),
        help=f"comma-separated subset of {','.join(CHECKS)} (default on cuda: all; "
        f"on cpu: {','.join(DEFAULT_CHECKS['cpu'])})",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--perf", action="store_true",
        help="instead of checking, time a llama3-8B-shaped stage's units at 32k and 64k "
        "tokens (k = 1, 2, 4, 8; every checkpointing mode) and predict Seq1F1B's step "
        "against 1F1B for pp = 4 and 8 (under 10 minutes on an H100)",
    )
    parser.add_argument(
        "--gpu-report", metavar="OUTDIR", type=Path,
        help="run --perf's table, the kernel and single-GPU checks and a compiled block "
        "within --budget-s, writing OUTDIR/report.json and OUTDIR/report.txt after every task",
    )
    parser.add_argument(
        "--budget-s", type=float, metavar="SECONDS",
        help="with --gpu-report: rows that would start too late are skipped "
        f"(default {DEFAULT_BUDGET_S:.0f})",
    )
    args = parser.parse_args(argv)
    if args.gpu_report:
        for given, flag in ((args.perf, "--perf"), (args.checks, "--checks"), (args.json, "--json")):
            if given:
                parser.error(f"--gpu-report runs its own sections into OUTDIR: leave out {flag}")
        if args.device is None and not torch.cuda.is_available():
            parser.error("--gpu-report: torch sees no CUDA device; --device cpu runs it small")
    elif args.budget_s is not None:
        parser.error("--budget-s is --gpu-report's time budget: add --gpu-report OUTDIR")
    if args.budget_s is not None and args.budget_s < 0:
        parser.error("--budget-s: seconds must be >= 0")
    if args.perf and args.checks:
        parser.error("--perf measures instead of checking: leave out --checks")
    unknown = set(args.checks or ()) - set(CHECKS)
    if unknown:
        parser.error(f"--checks: unknown {sorted(unknown)}; choose from {','.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args


def _run(name: str, device: torch.device) -> list[Result]:
    check, _ = CHECKS[name]
    started = time.perf_counter()
    print(f"running {name} ...", file=sys.stderr, flush=True)
    try:
        results = check(device)
    except Exception as crash:  # noqa: BLE001 - a crashed check is a failed row
        results = [Result(name, "fail", reason=f"crashed: {type(crash).__name__}: {crash}")]
    print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device is None and not torch.cuda.is_available():
        print("no CUDA device: nothing checked. On a CUDA machine this runs:")
        for name, (_, what) in CHECKS.items():
            print(f"  {name}: {what}")
        print("`--device cpu` runs the parts that can run on the CPU.")
        return 0
    device = torch.device(args.device or "cuda")
    if args.gpu_report:
        budget_s = DEFAULT_BUDGET_S if args.budget_s is None else args.budget_s
        given = sys.argv[1:] if argv is None else argv
        command = " ".join(["python -m torchtitan_seq1f1b.check", *given])
        return gpu_report(args.gpu_report, device, budget_s, command)
    if args.perf:
        return _perf(device, args.json)
    names = args.checks or DEFAULT_CHECKS[device.type]
    results = [row for name in names for row in _run(name, device)]
    print(format_table(results))
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    print(
        f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
        f"(device {device.type}, {gpus} GPUs, torch {torch.__version__})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device.type,
                    "gpus": gpus,
                    "torch": torch.__version__,
                    "results": [dataclasses.asdict(r) for r in results],
                },
                f,
                indent=1,
            )
    return 1 if counts["fail"] else 0


def _perf(device: torch.device, json_path: str | None) -> int:
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    started = time.perf_counter()
    rows = perf_results(device, shape)
    print(format_perf(rows, shape))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan``: options, their checks, the recommendation table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.planner import (
    AutoPlan,
    AutoPlanRequest,
    GIB,
    NoPlanFitsError,
    PARTITIONS,
    plan_automatically,
)
from torchtitan_seq1f1b.tools.simulate import (
    add_model_arguments,
    model_from_args,
    positive_float,
    positive_int,
    write_json,
)

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.plan",
        description=(
            "Time one transformer block and the LM head of a model shape on this device, "
            "segment by segment (cached per shape, device and dtype), then predict step time, "
            "bubble and per-rank memory of every k and partition under the schedule's real "
            "order and recommend the fastest plan that fits the memory budget."
        ),
    )
    add_model_arguments(parser, "named model shape (or give explicit dims)")
    run = parser.add_argument_group("layout")
    run.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    run.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks")
    run.add_argument("--microbatches", "-m", type=positive_int, required=True,
                     help="microbatches per step")
    run.add_argument("--schedule", choices=list(SCHEDULES), default="Seq1F1B")
    run.add_argument("--stages-per-rank", "-v", type=positive_int,
                     help="stages per rank (default: the schedule's least)")
    run.add_argument("--align", type=positive_int, default=1,
                     help="segment length multiple (times the TP degree under sequence parallel)")
    run.add_argument("--microbatch-size", type=positive_int, default=1)
    choice = parser.add_argument_group("what to choose from")
    choice.add_argument("--partitions", nargs="+", choices=PARTITIONS, default=list(PARTITIONS))
    choice.add_argument("--max-segments", type=positive_int, default=16)
    choice.add_argument("--memory-budget-gib", type=positive_float, metavar="GIB",
                        help="activations + K/V store per rank the plan must fit "
                             "(default: no bound)")
    device = parser.add_argument_group("calibration")
    device.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to time the block (default: cuda if available, else cpu)")
    device.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    device.add_argument("--attention-backend", default="auto",
                        choices=("auto", "flash", "varlen", "sdpa"))
    device.add_argument("--threads", type=positive_int,
                        help="CPU threads while timing (default: torch's; use what each rank gets)")
    device.add_argument("--recalibrate", action="store_true",
                        help="measure again even if this shape, device and dtype are cached")
    out = parser.add_argument_group("output")
    out.add_argument("--rows", type=positive_int, default=10, help="plans shown (default 10)")
    out.add_argument("--json", metavar="PATH", help="write every plan tried as JSON")
    return parser


def _request(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AutoPlanRequest:
    """Resolve defaults and reject what cannot run, before timing anything."""
    found = model_from_args(parser, args, default=None)
    if found is None:
        parser.error("give a model: --model NAME, or --layers/--dim/--heads (and more dims)")
    _, shape = found
    entry = SCHEDULES[args.schedule]
    stages_per_rank = args.stages_per_rank or entry.min_stages_per_rank
    most = entry.max_stages_per_rank
    if stages_per_rank < entry.min_stages_per_rank or (most is not None and stages_per_rank > most):
        parser.error(
            f"--stages-per-rank {stages_per_rank}: {args.schedule} runs between "
            f"{entry.min_stages_per_rank} and {most or 'any number of'} stages per rank"
        )
    if args.pp * stages_per_rank > shape.n_layers:
        parser.error(
            f"--pp {args.pp} x {stages_per_rank} stages per rank exceeds the model's "
            f"{shape.n_layers} blocks; lower --pp or --stages-per-rank"
        )
    if args.seq_len % args.align:
        parser.error(f"--seq-len {args.seq_len} is not a multiple of --align {args.align}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * GIB)
    return AutoPlanRequest(
        shape=shape,
        seq_len=args.seq_len,
        num_ranks=args.pp,
        stages_per_rank=stages_per_rank,
        microbatches=args.microbatches,
        order_for=entry.schedule_class.order_for,
        align=args.align,
        device=args.device,
        dtype=dtype,
        microbatch_size=args.microbatch_size,
        attention_backend=args.attention_backend,
        budget_bytes=budget,
        partitions=tuple(args.partitions),
        segment_counts=tuple(range(1, args.max_segments + 1)),
        refresh=args.recalibrate,
    )


def _toml_snippet(args: argparse.Namespace, plan: AutoPlan) -> str:
    best = plan.recommendation.best
    if best.partition == "time":
        lengths = f"segment_lengths = {list(best.plan.lengths)}"
    else:
        lengths = f'num_segments = {best.num_segments}\npartition = "{best.partition}"'
    return (
        f'[parallelism]\npipeline_parallel_schedule = "{args.schedule}"\n\n'
        f"[seq1f1b]\n{lengths}"
    )


def _records(plan: AutoPlan) -> list[dict]:
    chosen = plan.recommendation.best
    rows = plan.recommendation.fitting + plan.recommendation.over_budget
    return [
        {
            "num_segments": e.num_segments,
            "partition": e.partition,
            "segment_lengths": list(e.plan.lengths),
            "step_seconds": e.step_seconds,
            "bubble_fraction": e.bubble_fraction,
            "peak_bytes": list(e.peak_bytes),
            "fits_budget": e in plan.recommendation.fitting,
            "chosen": e is chosen,
            "calibrated_for": plan.time_model.calibrated_for,
        }
        for e in rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    request = _request(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        plan = plan_automatically(request)
    except NoPlanFitsError as error:
        parser.exit(2, f"{parser.prog}: --memory-budget-gib {args.memory_budget_gib}: {error}\n")
    best = plan.recommendation.best
    print(f"time model: {plan.calibration_source}")
    calibrated = plan.time_model.calibrated_for
    print(f"measured on {calibrated['device']} in {calibrated['dtype']}\n")
    print(plan.recommendation.table(args.rows))
    print(
        f"\nchosen: k={best.num_segments} {best.partition}, lengths {list(best.plan.lengths)}; "
        f"predicted step {best.step_seconds:.4f} s, bubble {best.bubble_fraction:.3f}, peak "
        f"{' '.join(f'{b / GIB:.3f}' for b in best.peak_bytes)} GiB per rank\n"
    )
    print("in a torchtitan 0.2.2 job config:\n" + _toml_snippet(args, plan))
    if args.json:
        write_json(parser, args.json, _records(plan))
    return 0

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan``: options, their checks, the recommendation table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from torchtitan_seq1f1b.integration import install, MAIN, titan_release
from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.planner import (
    AutoPlan,
    AutoPlanRequest,
    GIB,
    NoPlanFitsError,
    PARTITIONS,
    plan_automatically,
)
from torchtitan_seq1f1b.tools.plan.job_layout import JobLayout
from torchtitan_seq1f1b.context_parallel import check_context_parallel
from torchtitan_seq1f1b.tools.simulate import (
    add_context_parallel_arguments,
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
            "Time a pipeline rank's transformer blocks (at most 4, chained) and the LM head of "
            "a model shape on this device, segment by segment (cached per shape, device, dtype "
            "and chain), then predict step time, bubble and per-rank memory of every k and "
            "partition under the schedule's real order and recommend the fastest plan that "
            "fits the memory budget."
        ),
    )
    job = parser.add_argument_group(
        "job config (the options below, when given, override what it says)"
    )
    job.add_argument("--job-config", metavar="TOML_OR_NAME",
                     help="a torchtitan job config: under 0.2.2 a TOML file, under 0.3 the "
                          "name of a config function in --job-module's registry (as "
                          "torchtitan.train's --config takes it). It gives the model, "
                          "training.seq_len, pipeline degree, schedule, stages, microbatches, "
                          "seq1f1b align, attention_backend and memory_budget_gib, the "
                          "tensor-parallel degree folded into align, and the dtype FSDP "
                          "computes in (data_parallel_shard_degree = -1 counts as 1: pass "
                          "--dtype), and context_parallel_degree")
    job.add_argument("--job-module", metavar="MODULE",
                     help="torchtitan 0.3: the module whose config registry has --job-config "
                          "(default torchtitan_seq1f1b, as torchtitan.train's --module)")
    add_model_arguments(parser, "named model shape (or give explicit dims)")
    run = parser.add_argument_group("layout (required without --job-config)")
    run.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    run.add_argument("--pp", type=positive_int, help="pipeline ranks")
    run.add_argument("--microbatches", "-m", type=positive_int, help="microbatches per step")
    run.add_argument("--schedule", choices=list(SCHEDULES), help="default Seq1F1B")
    run.add_argument("--stages-per-rank", "-v", type=positive_int,
                     help="stages per rank (default: the schedule's least)")
    run.add_argument("--align", type=positive_int,
                     help="segment length multiple (default 1; times the TP degree under "
                          "sequence parallel)")
    run.add_argument("--microbatch-size", type=positive_int, help="default 1")
    add_context_parallel_arguments(run, default=None, default_text="the job's, else 1")
    choice = parser.add_argument_group("what to choose from")
    choice.add_argument("--partitions", nargs="+", choices=PARTITIONS, default=list(PARTITIONS))
    choice.add_argument("--max-segments", type=positive_int, default=16)
    choice.add_argument("--memory-budget-gib", type=positive_float, metavar="GIB",
                        help="activations + K/V store per rank the plan must fit "
                             "(default: no bound)")
    device = parser.add_argument_group("calibration")
    device.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to time the blocks (default: cuda if available, else cpu)")
    device.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    device.add_argument("--attention-backend", choices=("auto", "flash", "varlen", "sdpa"),
                        help="default auto")
    device.add_argument("--threads", type=positive_int,
                        help="CPU threads while timing (default: torch's; use what each rank gets)")
    device.add_argument("--recalibrate", action="store_true",
                        help="measure again even if this shape, device and dtype are cached")
    out = parser.add_argument_group("output")
    out.add_argument("--rows", type=positive_int, default=10, help="plans shown (default 10)")
    out.add_argument("--json", metavar="PATH", help="write every plan tried as JSON")
    return parser


def _job_layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> JobLayout:
    """The layout ``--job-config`` gives, with the explicit options written over it."""
    release = titan_release()
    if release not in ("0.2", "0.3", MAIN):
        parser.error(
            f"--job-config needs torchtitan 0.2.2, 0.3 or main "
            f"({f'{release} is installed' if release else 'none is installed'}): pip install "
            "'torchtitan-seq1f1b[titan02]' or '[titan03]', or give the model and layout options"
        )
    registry = release != "0.2"  # 0.3 and main: config functions of a registry
    if args.job_module is not None and not registry:
        parser.error("--job-module names a torchtitan 0.3 config registry; 0.2.2 job configs "
                     "are the TOML file --job-config names")
    if registry and args.job_config.endswith(".toml"):
        parser.error(
            f"--job-config {args.job_config}: TOML job configs are torchtitan 0.2.2's, and "
            f"torchtitan {release} is installed; name a config function of --job-module's "
            "registry instead (e.g. --job-config seq1f1b_debug)"
        )
    if release == MAIN and args.microbatch_size is not None:
        parser.error(
            f"--microbatch-size {args.microbatch_size}: a torchtitan main microbatch is one "
            "packed row; give its tokens as --seq-len"
        )
    install()
    schedule = [("parallelism.pipeline_parallel_schedule", args.schedule)]
    if registry and args.schedule is not None:
        # 0.3 names the torch schedule whose stage layout the Seq1F1B one runs on.
        schedule = [("seq1f1b.schedule", args.schedule),
                    ("parallelism.pipeline_parallel_schedule", SCHEDULES[args.schedule].layout_of)]
    folded, length_option = False, "training.seq_len"
    if registry:
        from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED, sequence_option

        folded, length_option = FOLDED, sequence_option()
    rows = None if folded else args.microbatch_size
    overrides = [
        f"--{key}={value}"
        for key, value in (
            (length_option, args.seq_len),
            ("parallelism.pipeline_parallel_degree", args.pp),
            *schedule,
            ("parallelism.pipeline_parallel_microbatch_size", rows),
            ("seq1f1b.align", args.align),
            ("seq1f1b.attention_backend", args.attention_backend),
            ("parallelism.context_parallel_degree", args.cp),
        )
        if value is not None
    ]
    if args.microbatches is not None and folded:
        overrides.append(f"--parallelism.num_pp_microbatches={args.microbatches}")
    elif args.microbatches is not None:
        overrides.append(f"--training.local_batch_size={args.microbatches * (rows or 1)}")
        if rows is None:
            overrides.append("--parallelism.pipeline_parallel_microbatch_size=1")
    args.job_overrides = overrides  # the job needs them too, to run the plan printed for it
    device = torch.device(args.device)
    try:
        if release == "0.2":
            from torchtitan_seq1f1b.tools.plan import titan_0_2_job

            return titan_0_2_job.read_job_layout(args.job_config, overrides, device)
        from torchtitan_seq1f1b.tools.plan import titan_0_3_job

        args.job_module = args.job_module or "torchtitan_seq1f1b"
        return titan_0_3_job.read_job_layout(args.job_module, args.job_config, overrides, device)
    except ValueError as error:
        parser.error(f"--job-config {args.job_config}: {error}")


def _request(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AutoPlanRequest:
    """Resolve defaults and reject what cannot run, before timing anything."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    found = model_from_args(parser, args, default=None)
    if args.job_module is not None and args.job_config is None:
        parser.error("--job-module names where --job-config's function is; give --job-config too")
    if args.job_config is not None:
        layout = _job_layout(parser, args)
        shape = found[1] if found else layout.shape
        seq_len, pp = layout.seq_len, layout.num_ranks
        microbatches, schedule = layout.microbatches, layout.schedule
        stages_per_rank = args.stages_per_rank or layout.stages_per_rank
        align, microbatch_size = layout.align, layout.microbatch_size
        attention_backend = layout.attention_backend
        budget_gib = args.memory_budget_gib or layout.memory_budget_gib
        dtype = _DTYPES[args.dtype] if args.dtype else layout.dtype
        args.cp = layout.context_parallel
    else:
        if found is None:
            parser.error(
                "give a model: --job-config (a torchtitan job config), --model NAME, or "
                "--layers/--dim/--heads (and more dims)"
            )
        missing = [flag for flag, value in (("--seq-len", args.seq_len), ("--pp", args.pp),
                                            ("--microbatches", args.microbatches)) if value is None]
        if missing:
            parser.error(f"give {', '.join(missing)} (or a --job-config that has them)")
        shape, seq_len, pp, microbatches = found[1], args.seq_len, args.pp, args.microbatches
        schedule = args.schedule or "Seq1F1B"
        stages_per_rank = args.stages_per_rank
        align, microbatch_size = args.align or 1, args.microbatch_size or 1
        attention_backend = args.attention_backend or "auto"
        budget_gib = args.memory_budget_gib
        args.cp = args.cp or 1
        dtype = _DTYPES[args.dtype] if args.dtype else (
            torch.bfloat16 if device.type == "cuda" else torch.float32
        )
    entry = SCHEDULES[schedule]
    stages_per_rank = stages_per_rank or entry.min_stages_per_rank
    most = entry.max_stages_per_rank
    if stages_per_rank < entry.min_stages_per_rank or (most is not None and stages_per_rank > most):
        parser.error(
            f"--stages-per-rank {stages_per_rank}: {schedule} runs between "
            f"{entry.min_stages_per_rank} and {most or 'any number of'} stages per rank"
        )
    if pp * stages_per_rank > shape.n_layers:
        parser.error(
            f"--pp {pp} x {stages_per_rank} stages per rank exceeds the model's "
            f"{shape.n_layers} blocks; lower --pp or --stages-per-rank"
        )
    if seq_len % align:
        parser.error(f"--seq-len {seq_len} is not a multiple of --align {align}")
    try:
        check_context_parallel(seq_len, align, args.cp)
    except ValueError as error:
        parser.error(f"--cp {args.cp}: {error}")
    args.schedule, args.memory_budget_gib = schedule, budget_gib  # as printed and reported
    return AutoPlanRequest(
        shape=shape,
        seq_len=seq_len,
        num_ranks=pp,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        order_for=entry.schedule_class.order_for,
        align=align,
        device=args.device,
        dtype=dtype,
        microbatch_size=microbatch_size,
        attention_backend=attention_backend,
        budget_bytes=None if budget_gib is None else int(budget_gib * GIB),
        partitions=tuple(args.partitions),
        segment_counts=tuple(range(1, args.max_segments + 1)),
        refresh=args.recalibrate,
        context_parallel=args.cp,
        cp_bytes_per_second=args.cp_bandwidth,
        cp_latency=args.cp_latency,
    )


def _job_settings(args: argparse.Namespace, plan: AutoPlan) -> str:
    """The chosen plan as the installed torchtitan's job config sets it (0.2.2 TOML without one).

    Under 0.3 a time-balanced pick is given as its lengths, with an integer k
    and a FLOP partition so that the job does not ask the planner again.
    """
    best = plan.recommendation.best
    time_balanced = best.partition == "time"
    if titan_release() in ("0.3", MAIN):
        pick = [f"--seq1f1b.num_segments {best.num_segments}",
                f"--seq1f1b.partition {'balanced' if time_balanced else best.partition}"]
        if time_balanced:
            pick.append(f"--seq1f1b.segment_lengths {' '.join(map(str, best.plan.lengths))}")
        job = (["--module", args.job_module, "--config", args.job_config, *args.job_overrides]
               if args.job_config else [])
        schedule = [f"--parallelism.pipeline_parallel_schedule {SCHEDULES[args.schedule].layout_of}",
                    f"--seq1f1b.schedule {args.schedule}"]
        if args.cp > 1:
            schedule.append(f"--parallelism.context_parallel_degree {args.cp}")
        return "for a torchtitan 0.3 job (torchrun ... -m torchtitan.train ...):\n" + " ".join(
            [*job, *schedule, *pick]
        )
    if time_balanced:
        cut = f"segment_lengths = {list(best.plan.lengths)}"
    else:
        cut = f'num_segments = {best.num_segments}\npartition = "{best.partition}"'
    cp = f"context_parallel_degree = {args.cp}\n" if args.cp > 1 else ""
    return (
        "in a torchtitan 0.2.2 job config:\n"
        f'[parallelism]\npipeline_parallel_schedule = "{args.schedule}"\n{cp}\n'
        f"[seq1f1b]\n{cut}"
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
    print(f"time model: {plan.calibration_source}; {plan.time_model.describe()}")
    calibrated = plan.time_model.calibrated_for
    print(f"measured on {calibrated['device']} in {calibrated['dtype']}")
    if args.cp > 1:
        print(f"context parallel degree {args.cp}: 1/{args.cp} of every segment per rank, K/V "
              f"all-gathered and reduce-scattered at {args.cp_bandwidth:.3g} bytes/s + "
              f"{args.cp_latency:g} s per collective")
    print()
    print(plan.recommendation.table(args.rows))
    print(
        f"\nchosen: k={best.num_segments} {best.partition}, lengths {list(best.plan.lengths)}; "
        f"predicted step {best.step_seconds:.4f} s, bubble {best.bubble_fraction:.3f}, peak "
        f"{' '.join(f'{b / GIB:.3f}' for b in best.peak_bytes)} GiB per rank\n"
    )
    print(_job_settings(args, plan))
    if args.json:
        write_json(parser, args.json, _records(plan))
    return 0

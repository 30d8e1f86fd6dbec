# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.simulate``: options, their checks, and the run they ask for."""

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import replace

from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig
from torchtitan_seq1f1b.planner import ContextParallelCost
from torchtitan_seq1f1b.segmenting import DocumentLengths, TransformerCost
from torchtitan_seq1f1b.tools.model_shapes import get_preset, MODEL_PRESETS
from torchtitan_seq1f1b.tools.simulate.config import (
    MemoryModel,
    PARTITIONS,
    SimConfig,
)
from torchtitan_seq1f1b.tools.simulate.paper import run_paper
from torchtitan_seq1f1b.tools.simulate.schedules import SCHEDULE_SPECS, SCHEDULES
from torchtitan_seq1f1b.tools.simulate.step import simulate, SimResult
from torchtitan_seq1f1b.tools.simulate.tables import (
    print_paper,
    print_plan_comparison,
    print_results,
)

__all__ = [
    "add_context_parallel_arguments",
    "add_model_arguments",
    "document_lengths",
    "main",
    "model_from_args",
    "number_at_least",
    "positive_float",
    "positive_int",
    "write_json",
]

# What the CLI runs without --schedule; "--schedule all" runs every schedule.
DEFAULT_SCHEDULES = ("1F1B", "GPipe", "Seq1F1B")
# "time" needs a calibrated time model: the bench and the planner command have one.
_FLOP_PARTITIONS = tuple(p for p in PARTITIONS if p != "time")
DEFAULT_SHAPE = {"model": "llama3-8b", "seq_len": 32768, "pp": 4, "microbatches": 8}
"""What runs without options: train_configs/llama3_8b_32k_seq1f1b.toml's shape."""


def number_at_least(
    convert: Callable[[str], float], least: float, expected: str
) -> Callable[[str], float]:
    """An argparse ``type`` converting with ``convert`` and rejecting values below ``least``."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not value >= least:  # also rejects nan
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


positive_int = number_at_least(int, 1, "a positive integer")
positive_float = number_at_least(float, 1e-9, "a number > 0")
_non_negative_float = number_at_least(float, 0, "a number >= 0")
_non_negative_int = number_at_least(int, 0, "an integer >= 0")
# --linear-* shape options: GatedDeltaNetConfig's field each sets.
_LINEAR_SHAPE_OPTIONS = {
    "linear_key_heads": "n_key_heads",
    "linear_value_heads": "n_value_heads",
    "linear_key_dim": "key_head_dim",
    "linear_value_dim": "value_head_dim",
    "linear_conv_width": "conv_kernel_size",
}


def _schedule_names(text: str) -> list[str]:
    if text.lower() == "all":
        return list(SCHEDULES)
    for name in SCHEDULES:
        if text.lower() == name.lower():
            return [name]
    raise argparse.ArgumentTypeError(
        f"unknown schedule {text!r}; choose from {', '.join(SCHEDULES)} or all"
    )


def document_lengths(text: str) -> tuple[str, DocumentLengths]:
    """An argparse ``type`` for ``--documents``: the spec as typed, and its distribution."""
    try:
        return text, DocumentLengths.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.simulate",
        description=(
            "Simulate pipeline timelines (Seq1F1B and its interleaved and zero-bubble "
            "variants, torch's 1F1B, GPipe, Interleaved1F1B, LoopedBFS, ZBVZeroBubble) and "
            "per-rank peak memory from the exact action orders the schedules run. Times are "
            "in forwards of one whole microbatch over one rank's share of the model; "
            "backward = 2 x forward. Without options it simulates "
            f"--model {DEFAULT_SHAPE['model']} --seq-len {DEFAULT_SHAPE['seq_len']} "
            f"--pp {DEFAULT_SHAPE['pp']} -m {DEFAULT_SHAPE['microbatches']} -k 4; the table "
            "ends with a legend of its columns."
        ),
    )
    add_model_arguments(
        parser, f"named model shape (default {DEFAULT_SHAPE['model']} unless "
        "--layers/--dim/--heads are given)"
    )

    run = parser.add_argument_group("parallelism and schedule")
    run.add_argument("--seq-len", type=positive_int,
                     help=f"tokens per sequence (default {DEFAULT_SHAPE['seq_len']})")
    run.add_argument("--pp", type=positive_int,
                     help=f"pipeline ranks (default {DEFAULT_SHAPE['pp']})")
    run.add_argument("--tp", type=positive_int, default=1, help="tensor parallel degree")
    run.add_argument("--dp", type=positive_int, default=1, help="data parallel degree")
    add_context_parallel_arguments(run)
    run.add_argument("--device-flops", type=positive_float, metavar="FLOP_PER_S",
                     default=SimConfig.device_flops,
                     help="FLOP/s one rank achieves, which prices --cp's collectives in "
                          "forwards (default %(default).0e, an assumption; ignored without --cp)")
    run.add_argument("--microbatches", "-m", type=positive_int,
                     help=f"microbatches per step (default {DEFAULT_SHAPE['microbatches']})")
    run.add_argument("--segments", "-k", type=positive_int, default=4,
                     help="segments per microbatch of the Seq1F1B schedules (torch's use 1)")
    run.add_argument("--chunks", "-v", "--v", type=positive_int, default=None,
                     help="stages (model chunks) per rank of the multi-stage schedules "
                          "(default 2); the others run 1")
    run.add_argument("--partition", choices=_FLOP_PARTITIONS,
                     default="balanced",
                     help="segment lengths: equal, equal forward FLOPs, or equal FLOPs under "
                          "dense causal attention even with --documents")
    run.add_argument("--documents", type=document_lengths, metavar="SPEC",
                     help="sequences pack documents with these lengths (lognormal:MEAN[:SIGMA] "
                          "or fixed:LENGTH, e.g. lognormal:2048) and attention is "
                          "document-masked; also compares the segment plans under them")
    run.add_argument("--align", type=positive_int, default=None,
                     help="segment length multiple (default: tp with sequence parallel, else 1)")
    run.add_argument("--schedule", type=_schedule_names, nargs="+",
                     default=[list(DEFAULT_SCHEDULES)], metavar="NAME",
                     help=f"one or more of {', '.join(SCHEDULES)}, or all "
                          f"(default: {' '.join(DEFAULT_SCHEDULES)})")
    run.add_argument("--backward-split", choices=("equal", "flops"), default="equal",
                     help="I/W cost of split backwards: I = W = forward, or W = "
                          "weight-gradient FLOPs and I the rest (attention)")
    run.add_argument("--p2p-latency", type=_non_negative_float, default=0.0,
                     help="added to every cross-rank dependency, in microbatch-forward units")

    gdn = parser.add_argument_group(
        "linear attention (GatedDeltaNet layers: a carried state instead of a K/V store)"
    )
    gdn.add_argument("--linear-layers", type=_non_negative_int, default=0, metavar="N",
                     help="how many of the layers are GatedDeltaNet, spread evenly over the "
                          "stages (qwen3_5: 3 of every 4; default 0)")
    for flag, default_text in (
        ("--linear-key-heads", "--kv-heads"),
        ("--linear-value-heads", "--heads"),
        ("--linear-key-dim", "the attention head dim"),
        ("--linear-value-dim", "the attention head dim"),
        ("--linear-conv-width", "4"),
    ):
        gdn.add_argument(flag, type=positive_int, help=f"default: {default_text}")

    mem = parser.add_argument_group("memory model")
    mem.add_argument("--micro-batch-size", type=positive_int, default=1)
    mem.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    mem.add_argument("--attention", choices=("flash", "eager"), default="flash",
                     help="eager stores score matrices (the 5as/h term); flash does not")
    mem.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True,
                     help="store dropout masks (Korthikanti's 34 includes them)")
    mem.add_argument("--kv-store", choices=("preallocated", "prefix"), default="preallocated",
                     help="this repo's whole-sequence K/V buffers, or the paper's growing prefix")
    mem.add_argument("--distributed-optimizer", action="store_true",
                     help="shard fp32 master weights and Adam states over dp")

    out = parser.add_argument_group("output")
    out.add_argument("--paper", action="store_true",
                     help="reproduce the paper's peak-memory figure (ignores the options above)")
    out.add_argument("--json", metavar="PATH", help="also write the results as a JSON list")
    return parser


def add_model_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The model shape options: ``--model`` (a preset) or explicit dims."""
    model = parser.add_argument_group("model (a preset, or explicit dims)")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), help=model_help)
    for flag, help_text in (
        ("--layers", "transformer blocks"),
        ("--dim", "model width"),
        ("--heads", "query heads"),
        ("--kv-heads", "K/V heads (default: --heads)"),
        ("--ffn-dim", "MLP hidden width (default: 4 * --dim)"),
        ("--vocab", "vocabulary size (default 128256)"),
    ):
        model.add_argument(flag, type=positive_int, help=help_text)
    model.add_argument("--gated-mlp", action=argparse.BooleanOptionalAction, default=None,
                       help="SwiGLU MLP (explicit dims only; default on)")


def add_context_parallel_arguments(
    group: argparse._ArgumentGroup, default: int | None = 1, default_text: str = "1"
) -> None:
    """``--cp`` and its collectives' speed (:class:`ContextParallelCost`)."""
    group.add_argument("--cp", type=positive_int, default=default, metavar="C",
                       help=f"context parallel degree inside every segment (default "
                            f"{default_text}): activations per rank divide by C, the gathered "
                            "K/V store does not; segments are multiples of 2C")
    group.add_argument("--cp-bandwidth", type=positive_float, metavar="BYTES_PER_S",
                       default=ContextParallelCost.bytes_per_second,
                       help="bytes a rank moves per second in the CP all-gather and "
                            "reduce-scatter (default %(default).0e, an assumption)")
    group.add_argument("--cp-latency", type=_non_negative_float, metavar="SECONDS",
                       default=ContextParallelCost.latency,
                       help="seconds each CP collective costs whatever its size "
                            "(default %(default)g, an assumption)")


def model_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, default: str | None
) -> tuple[str, TransformerCost] | None:
    """The shape :func:`add_model_arguments` options give; ``default`` names the preset
    taken when none is given (None: return None)."""
    dims = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads}
    extras = (args.kv_heads, args.ffn_dim, args.vocab, args.gated_mlp)
    explicit = any(v is not None for v in (*dims.values(), *extras))
    if args.model is not None or not explicit:
        if explicit:
            parser.error(
                "give either --model or explicit dims (--layers/--dim/--heads...), not both"
            )
        name = args.model or default
        return None if name is None else (name, get_preset(name))
    missing = [flag for flag, value in dims.items() if value is None]
    if missing:
        parser.error(
            f"explicit dims need all of --layers, --dim, --heads (missing "
            f"{', '.join(missing)}), or use --model (one of {', '.join(sorted(MODEL_PRESETS))})"
        )
    try:
        return "custom", TransformerCost(
            n_layers=args.layers,
            dim=args.dim,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads or args.heads,
            ffn_hidden_dim=args.ffn_dim or 4 * args.dim,
            vocab_size=args.vocab or 128256,
            gated_mlp=True if args.gated_mlp is None else args.gated_mlp,
        )
    except ValueError as error:
        parser.error(str(error))


def _chunks_per_schedule(
    parser: argparse.ArgumentParser, names: list[str], chunks: int | None
) -> dict[str, int | None]:
    """--chunks applies to the multi-stage schedules; the others run one stage per rank."""
    multi = [name for name in names if SCHEDULE_SPECS[name].multi_stage]
    if chunks is not None and chunks > 1 and not multi:
        every_multi = [name for name, spec in SCHEDULE_SPECS.items() if spec.multi_stage]
        parser.error(
            f"--chunks/-v {chunks}: the selected schedules ({', '.join(names)}) run one "
            "stage per rank; drop --chunks, or pick an interleaved schedule with "
            f"--schedule ({', '.join(every_multi)})"
        )
    for name in multi:
        problem = chunks is not None and SCHEDULE_SPECS[name].chunks_problem(name, chunks)
        if problem:
            parser.error(f"--chunks/-v {chunks}: {problem}")
    return {name: chunks if name in multi else None for name in names}


def _linear_attention_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: TransformerCost
) -> tuple[TransformerCost, GatedDeltaNetConfig]:
    """The model with ``--linear-layers`` GatedDeltaNet layers, and their shape."""
    try:
        model = replace(model, linear_layers=args.linear_layers)
    except ValueError:
        parser.error(
            f"--linear-layers {args.linear_layers}: the model has {model.n_layers} layers; "
            f"give at most {model.n_layers}"
        )
    given = {field: getattr(args, option) for option, field in _LINEAR_SHAPE_OPTIONS.items()}
    try:
        shape = replace(
            GatedDeltaNetConfig.like_attention(model),
            **{field: value for field, value in given.items() if value is not None},
        )
    except ValueError as error:
        parser.error(f"--linear-key-heads/--linear-value-heads: {error}")
    return model, shape


def _configs_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[SimConfig]:
    model_name, model = model_from_args(parser, args, DEFAULT_SHAPE["model"])
    model, linear_attention = _linear_attention_from_args(parser, args, model)
    for option in ("seq_len", "pp", "microbatches"):
        if getattr(args, option) is None:
            setattr(args, option, DEFAULT_SHAPE[option])
    memory = MemoryModel(
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
        dropout=args.dropout,
        kv_store=args.kv_store,
        distributed_optimizer=args.distributed_optimizer,
        micro_batch_size=args.micro_batch_size,
    )
    base = dict(
        model=model, model_name=model_name, seq_len=args.seq_len, pp=args.pp, tp=args.tp,
        dp=args.dp, cp=args.cp, cp_bytes_per_second=args.cp_bandwidth,
        cp_latency=args.cp_latency, device_flops=args.device_flops,
        microbatches=args.microbatches, segments=args.segments,
        partition=args.partition, p2p_latency=args.p2p_latency, align=args.align,
        backward_split=args.backward_split, memory=memory, linear_attention=linear_attention,
    )
    if args.documents is not None:
        base["documents_name"], base["documents"] = args.documents
    # De-duplicate, keep order.
    names = list(dict.fromkeys(name for group in args.schedule for name in group))
    configs = []
    for name, chunks in _chunks_per_schedule(parser, names, args.chunks).items():
        try:
            config = SimConfig(schedule=name, v=chunks, **base)
            config.plan()  # segment-length errors surface here, as usage errors
            configs.append(config)
        except ValueError as error:
            parser.error(str(error))
    return configs


def _plan_comparison(configs: list[SimConfig]) -> list[SimResult]:
    """Every segmented schedule simulated with each partition, under the same documents."""
    return [
        simulate(replace(config, partition=partition))
        for config in configs
        if config.num_segments > 1
        for partition in _FLOP_PARTITIONS
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default ``sys.argv[1:]``); 0 on success."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.paper:
        records = run_paper()
        print_paper(records)
    else:
        configs = _configs_from_args(parser, args)
        results = [simulate(config) for config in configs]
        print_results(results)
        records = [r.to_record() for r in results]
        if args.documents is not None:
            plans = _plan_comparison(configs)
            if plans:
                print_plan_comparison(plans)
                records += [r.to_record() for r in plans]
    if args.json:
        write_json(parser, args.json, records)
    return 0


def write_json(parser: argparse.ArgumentParser, path: str, records: list[dict]) -> None:
    """Write a command's ``--json`` records; an unwritable path exits like a bad option."""
    try:
        with open(path, "w") as handle:
            json.dump(records, handle, indent=1)
    except OSError as error:
        parser.exit(1, f"{parser.prog}: error: cannot write --json {path}: {error}\n")

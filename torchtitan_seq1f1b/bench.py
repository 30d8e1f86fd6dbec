# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Real CPU benchmark of pipeline schedules: step time, bubble, activation memory.

Run ``python -m torchtitan_seq1f1b.bench --help``. Every schedule row trains
the same causal transformer (:class:`TinyTransformer`, llama-style with GQA;
same seeded weights and tokens for every row) on ``pp`` gloo ranks, one CPU
thread each, and measures:

- step time: median over ``--steps`` steps (after warm-up) of the wall time
  between two barriers around ``schedule.step``. Steps go round-robin over
  the rows, and the ratio to 1F1B is the median of per-round ratios, so a
  machine whose speed drifts (shared or virtual CPUs) biases no row;
- bubble fraction per rank: time blocked on pipeline p2p waits, plus the
  time spent at the closing barrier after this rank's last action, over the
  step time (see :func:`~torchtitan_seq1f1b._torch_compat.timed_p2p_waits`);
- peak activation bytes per rank, measured in one extra step from the
  tensors autograd saves for backward plus the K/V stores
  (:class:`~torchtitan_seq1f1b.probes.ActivationMemoryProbe`);
- compute spans of every forward/backward of the median step, for
  timeline plots (``python -m torchtitan_seq1f1b.plot timeline --bench``).

Ratios are against torch's ``Schedule1F1B`` with the same microbatch count,
printed next to what :mod:`torchtitan_seq1f1b.simulate` predicts for the same
model and layout when it knows the schedule. ``--quick`` runs a small model
and a few rows (used by the test suite). Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from torchtitan_seq1f1b.check.launch import run_ranks
from torchtitan_seq1f1b._torch_compat.introspection import timed_p2p_waits
from torchtitan_seq1f1b.examples.tiny_transformer import (
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)
from torchtitan_seq1f1b.probes import ActivationMemoryProbe, ComputeRecorder, ComputeSpan
from torchtitan_seq1f1b.schedule import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan
from torchtitan_seq1f1b.tools.model_shapes import embedding_params, final_norm_params, layer_params
from torchtitan_seq1f1b.tools.simulate import (
    MemoryModel,
    number_at_least,
    positive_int,
    SCHEDULES as SIMULATED_SCHEDULES,
    SimConfig,
    simulate,
    SimResult,
    write_json,
)

__all__ = [
    "BenchConfig",
    "BenchPreset",
    "BenchRow",
    "BenchSchedule",
    "FULL_PRESET",
    "QUICK_PRESET",
    "SCHEDULES",
    "main",
    "memory_model",
    "plan_rows",
    "predict",
    "print_table",
    "run_bench",
]

MIB = 2**20
BASELINE = "1F1B"


# ---- the schedule table --------------------------------------------------------


def _microbatches_at_least_pp(pp: int, microbatches: int) -> str | None:
    if microbatches < pp:
        return f"needs microbatches >= pp ({microbatches} < {pp})"
    return None


def _whole_rounds(pp: int, microbatches: int) -> str | None:
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return f"needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}"
    return None


@dataclass(frozen=True)
class BenchSchedule:
    """One schedule the benchmark can run.

    Args:
        name: row label; also the schedule's name in the simulator, which
            predicts the rows whose name it lists in ``simulate.SCHEDULES``.
        schedule_cls: the schedule class.
        stages_per_rank: model chunks per rank (v); the model is cut into
            ``pp * stages_per_rank`` stages of equal layer counts.
        placement: "loop" (rank r holds stages r, r + pp, ...) or "v" (rank r
            holds r and 2 pp - 1 - r, as ZBV needs).
        segmented: a Seq1F1B schedule, built with a SegmentPlan.
        default_segments: k values run when ``--segments`` is not given.
        constraint: ``constraint(pp, microbatches)`` -> why the schedule
            rejects that layout, or None.
    """

    name: str
    schedule_cls: type
    stages_per_rank: int = 1
    placement: str = "loop"
    segmented: bool = False
    default_segments: tuple[int, ...] = (1,)
    constraint: Callable[[int, int], str | None] | None = None

    def stage_indices(self, rank: int, pp: int) -> list[int]:
        if self.placement == "v":
            return [rank, 2 * pp - 1 - rank]
        return [rank + chunk * pp for chunk in range(self.stages_per_rank)]


SCHEDULES: dict[str, BenchSchedule] = {
    spec.name: spec
    for spec in (
        BenchSchedule("1F1B", Schedule1F1B, constraint=_microbatches_at_least_pp),
        BenchSchedule("GPipe", ScheduleGPipe),
        BenchSchedule(
            "Interleaved1F1B", ScheduleInterleaved1F1B, stages_per_rank=2,
            constraint=_whole_rounds,
        ),
        BenchSchedule("LoopedBFS", ScheduleLoopedBFS, stages_per_rank=2),
        BenchSchedule("ZBVZeroBubble", ScheduleZBVZeroBubble, stages_per_rank=2, placement="v"),
        BenchSchedule(
            "Seq1F1B", ScheduleSeq1F1B, segmented=True, default_segments=(1, 2, 4, 8)
        ),
        BenchSchedule(
            "InterleavedSeq1F1B", ScheduleInterleavedSeq1F1B, stages_per_rank=2,
            segmented=True, default_segments=(1, 2, 4),
        ),
        BenchSchedule(
            "Seq1F1BZeroBubble", ScheduleSeq1F1BZeroBubble, segmented=True,
            default_segments=(1, 2, 4),
        ),
        BenchSchedule(
            "Seq1F1BZBV", ScheduleSeq1F1BZBV, stages_per_rank=2, placement="v",
            segmented=True, default_segments=(1, 2, 4),
        ),
    )
}


# ---- configuration ----------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """Model, data and repetition settings shared by every row.

    Args:
        model: the transformer's shape.
        seq_len: tokens per sequence.
        pp: pipeline ranks.
        microbatch_size: sequences per microbatch.
        steps: timed steps per row (the median is reported).
        warmup_steps: untimed steps first (shape inference, allocator warm-up).
        seed: weights and tokens.
    """

    model: TinyTransformerArgs
    seq_len: int
    pp: int
    microbatch_size: int = 1
    steps: int = 5
    warmup_steps: int = 1
    seed: int = 0

    def describe(self) -> dict:
        args, shape = self.model, self.model.cost()
        parameters = (
            shape.n_layers * layer_params(shape, tp=1)
            + 2 * embedding_params(shape, tp=1)  # untied input embedding and LM head
            + final_norm_params(shape)
        )
        return {
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "n_kv_heads": args.n_kv_heads,
            "ffn_hidden_dim": args.ffn_hidden_dim,
            "vocab_size": args.vocab_size,
            "seq_len": self.seq_len,
            "microbatch_size": self.microbatch_size,
            "parameters": parameters,
            "dtype": "float32",
            "attention": "SDPA (CPU flash kernel)",
        }


@dataclass(frozen=True)
class BenchRow:
    """One measured configuration: a schedule, m, and (Seq1F1B) k and partition."""

    schedule: str
    microbatches: int
    segments: int = 1
    partition: str | None = None

    @property
    def spec(self) -> BenchSchedule:
        return SCHEDULES[self.schedule]

    def plan(self, config: BenchConfig) -> SegmentPlan:
        if self.partition == "balanced":
            return SegmentPlan.balanced(config.seq_len, self.segments, config.model.cost())
        return SegmentPlan.uniform(config.seq_len, self.segments)

    def label(self) -> str:
        if not self.spec.segmented:
            return self.schedule
        partition = f" {self.partition}" if self.segments > 1 else ""
        return f"{self.schedule} k={self.segments}{partition}"


def plan_rows(
    schedules: Sequence[str],
    microbatches: Sequence[int],
    segments: Sequence[int] | None,
    partitions: Sequence[str],
) -> list[BenchRow]:
    """Every row to run; Seq1F1B's k = 1 once (both partitions coincide)."""
    rows = []
    for m in microbatches:
        for name in schedules:
            spec = SCHEDULES[name]
            if not spec.segmented:
                rows.append(BenchRow(name, m))
                continue
            for k in segments or spec.default_segments:
                for partition in partitions if k > 1 else ("uniform",):
                    rows.append(BenchRow(name, m, k, partition))
    return rows


# ---- one rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTiming:
    """One step on one rank; times are ``time.perf_counter`` seconds (one clock per machine).

    ``start`` is when the opening barrier released the rank, ``finish`` when
    its ``schedule.step`` returned, ``end`` when the closing barrier released it.
    """

    start: float
    finish: float
    end: float
    p2p_wait_seconds: float
    spans: list[ComputeSpan]

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def bubble_fraction(self) -> float:
        """Blocked on p2p, or done and waiting for the other ranks, over the step."""
        return (self.p2p_wait_seconds + self.end - self.finish) / self.seconds

    @property
    def compute_fraction(self) -> float:
        return sum(span.end - span.start for span in self.spans) / self.seconds


@dataclass(frozen=True)
class RankRun:
    """What one rank measured for one row."""

    steps: list[StepTiming]
    peak_bytes: int
    peak_saved_bytes: int
    peak_kv_bytes: int


def _batch(config: BenchConfig, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded tokens and targets: (microbatches * microbatch_size, seq_len)."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    shape = (microbatches * config.microbatch_size, config.seq_len)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    target = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    return tokens, target


def _build_schedule(row: BenchRow, stages: list[PipelineStage], config: BenchConfig):
    spec = row.spec
    if spec.segmented:
        return spec.schedule_cls(
            stages,
            row.microbatches,
            row.plan(config),
            loss_fn=token_sum_cross_entropy,
            positions_kwarg="positions",
        )
    if issubclass(spec.schedule_cls, PipelineScheduleSingle):
        return spec.schedule_cls(stages[0], row.microbatches, loss_fn=token_sum_cross_entropy)
    return spec.schedule_cls(stages, row.microbatches, loss_fn=token_sum_cross_entropy)


class _RankRow:
    """One row's stages and schedule on this rank, ready to step."""

    def __init__(self, rank: int, pp: int, model: TinyTransformer, config: BenchConfig, row: BenchRow):
        spec = row.spec
        num_stages = pp * spec.stages_per_rank
        indices = spec.stage_indices(rank, pp)
        self.parts = [model.stage(i, num_stages) for i in indices]
        self.stages = [
            PipelineStage(part, i, num_stages, torch.device("cpu"))
            for part, i in zip(self.parts, indices)
        ]
        self.schedule = _build_schedule(row, self.stages, config)
        self.kv_stores = [self.schedule.kv_stores[i] for i in indices] if spec.segmented else []
        tokens, target = _batch(config, row.microbatches)
        self.inputs = (tokens,) if 0 in indices else ()
        self.target = target if num_stages - 1 in indices else None

    def synchronised_step(self) -> StepTiming:
        """One step between two barriers, timing its p2p waits and compute calls."""
        for part in self.parts:
            part.zero_grad(set_to_none=False)
        with timed_p2p_waits() as waits, ComputeRecorder(self.stages) as recorder:
            dist.barrier()
            start = time.perf_counter()
            self.schedule.step(*self.inputs, target=self.target, return_outputs=False)
            finish = time.perf_counter()
            dist.barrier()
            end = time.perf_counter()
        return StepTiming(start, finish, end, waits.seconds, recorder.spans)

    def measure_memory(self) -> ActivationMemoryProbe:
        # Its own step: saved-tensor hooks cost time the timed steps should not pay.
        with ActivationMemoryProbe(self.parts, self.kv_stores) as probe:
            self.synchronised_step()
        return probe


def _rank_worker(
    rank: int, world_size: int, config: BenchConfig, rows: list[BenchRow]
) -> list[RankRun]:
    """Every row on this rank, from the same initial weights (each row copies its stages).

    Steps go round-robin over the rows, so a machine that slows down for a
    while (shared or virtual CPUs) slows every row alike instead of a few.
    """
    torch.manual_seed(config.seed)
    model = TinyTransformer(config.model)
    prepared = [_RankRow(rank, world_size, model, config, row) for row in rows]
    for _ in range(config.warmup_steps):
        for row in prepared:
            row.synchronised_step()
    timings: list[list[StepTiming]] = [[] for _ in rows]
    for _ in range(config.steps):
        for row, steps in zip(prepared, timings):
            steps.append(row.synchronised_step())
    runs = []
    for row, steps in zip(prepared, timings):
        probe = row.measure_memory()
        runs.append(RankRun(steps, probe.peak_bytes, probe.peak_saved_bytes, probe.peak_kv_bytes))
    return runs


# ---- records -------------------------------------------------------------------------


def _actions(row: BenchRow, runs: list[RankRun], step: int) -> list[dict]:
    """Compute spans of ``step`` on every rank, in seconds from its earliest start."""
    origin = min(run.steps[step].start for run in runs)
    k = row.segments
    actions = []
    for rank, run in enumerate(runs):
        for span in run.steps[step].spans:
            microbatch, segment = divmod(span.chunk, k)
            actions.append({
                "rank": rank,
                "stage": span.stage,
                "kind": span.kind,
                "microbatch": microbatch,
                "segment": segment,
                "start": span.start - origin,
                "end": span.end - origin,
            })
    return actions


def _record(config: BenchConfig, row: BenchRow, runs: list[RankRun]) -> dict:
    step_times = [max(step.seconds for step in steps) for steps in zip(*(r.steps for r in runs))]
    median_step = step_times.index(statistics.median_low(step_times))
    bubbles = [statistics.median(step.bubble_fraction for step in r.steps) for r in runs]
    return {
        "schedule": row.schedule,
        "label": row.label(),
        "pp": config.pp,
        "stages_per_rank": row.spec.stages_per_rank,
        "placement": row.spec.placement,
        "microbatches": row.microbatches,
        "segments": row.segments,
        "partition": row.partition,
        "segment_lengths": list(row.plan(config).lengths) if row.spec.segmented else None,
        "step_time_s": statistics.median(step_times),
        "step_times_s": step_times,
        "peak_activation_bytes": [run.peak_bytes for run in runs],
        "peak_saved_tensor_bytes": [run.peak_saved_bytes for run in runs],
        "peak_kv_store_bytes": [run.peak_kv_bytes for run in runs],
        "bubble_fraction": statistics.fmean(bubbles),
        "bubble_fraction_per_rank": bubbles,
        "compute_fraction_per_rank": [
            statistics.median(step.compute_fraction for step in r.steps) for r in runs
        ],
        "model": config.describe(),
        "steps": config.steps,
        "warmup_steps": config.warmup_steps,
        "actions": _actions(row, runs, median_step),
    }


def memory_model(microbatch_size: int = 1) -> MemoryModel:
    """The simulator's memory model for what the bench runs.

    No TP, no dropout, SDPA's CPU flash kernel (no score matrix saved), this
    repo's preallocated K/V store. The simulator counts bf16 activations with
    Korthikanti's per-token constants, the bench measures fp32 tensors: compare
    ratios to 1F1B, not bytes.
    """
    return MemoryModel(
        sequence_parallel=False,
        attention="flash",
        dropout=False,
        kv_store="preallocated",
        micro_batch_size=microbatch_size,
    )


def predict(config: BenchConfig, row: BenchRow) -> SimResult | None:
    """The simulator's result for ``row``, or None if it does not model that schedule."""
    if row.schedule not in SIMULATED_SCHEDULES:
        return None
    try:
        sim_config = SimConfig(
            model=config.model.cost(),
            model_name="bench",
            seq_len=config.seq_len,
            pp=config.pp,
            microbatches=row.microbatches,
            segments=row.segments,
            schedule=row.schedule,
            v=row.spec.stages_per_rank,
            partition=row.partition or "uniform",
            memory=memory_model(config.microbatch_size),
        )
    except (NotImplementedError, ValueError):  # a layout the simulator does not model
        return None
    return simulate(sim_config)


def _activation_peaks(result: SimResult) -> list[int]:
    """Simulated activation + K/V peak per rank (model states left out)."""
    return [r.peak_memory_bytes - r.model_state_bytes for r in result.ranks]


def _add_comparisons(config: BenchConfig, rows: list[BenchRow], records: list[dict]) -> None:
    """Ratios against 1F1B (same m), measured and simulated, added to each record."""
    baselines = {
        row.microbatches: (record, predict(config, row))
        for row, record in zip(rows, records)
        if row.schedule == BASELINE
    }
    for row, record in zip(rows, records):
        predicted = predict(config, row)
        record["predicted"] = None if predicted is None else {
            "makespan": predicted.makespan,
            "bubble_fraction": predicted.bubble_fraction,
            "peak_activation_bytes": _activation_peaks(predicted),
        }
        base_record, base_predicted = baselines.get(row.microbatches, (None, None))
        if base_record is None:
            continue
        # Paired by round: both steps ran within one pass over the rows.
        record["step_time_ratios"] = [
            mine / base for mine, base in zip(record["step_times_s"], base_record["step_times_s"])
        ]
        record["step_time_ratio"] = statistics.median(record["step_time_ratios"])
        record["peak_activation_ratio"] = (
            record["peak_activation_bytes"][0] / base_record["peak_activation_bytes"][0]
        )
        if predicted is not None and base_predicted is not None:
            record["predicted"]["step_time_ratio"] = predicted.makespan / base_predicted.makespan
            record["predicted"]["peak_activation_ratio"] = (
                _activation_peaks(predicted)[0] / _activation_peaks(base_predicted)[0]
            )


def run_bench(config: BenchConfig, rows: list[BenchRow], timeout: float = 3600) -> list[dict]:
    """Run every row on ``config.pp`` local gloo ranks; one record per row."""
    per_rank = run_ranks(_rank_worker, config.pp, config, rows, timeout=timeout)
    records = [
        _record(config, row, [per_rank[rank][i] for rank in range(config.pp)])
        for i, row in enumerate(rows)
    ]
    _add_comparisons(config, rows, records)
    return records


# ---- output ---------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(config: BenchConfig, records: list[dict]) -> None:
    model = config.describe()
    print(
        f"model: dim={model['dim']} layers={model['n_layers']} heads={model['n_heads']} "
        f"kv_heads={model['n_kv_heads']} ffn={model['ffn_hidden_dim']} "
        f"vocab={model['vocab_size']} ({model['parameters'] / 1e6:.1f}M params, fp32) "
        f"seq_len={config.seq_len} microbatch_size={config.microbatch_size} pp={config.pp}; "
        f"median of {config.steps} steps after {config.warmup_steps} warm-up"
    )
    print("ratios are against torch Schedule1F1B with the same m; sim = simulator prediction")
    header = (
        f"{'schedule':<32} {'m':>2} {'step s':>7} {'x1F1B':>6} {'sim':>6} "
        f"{'bubble':>6} {'sim':>6} {'r0 act MiB':>10} {'x1F1B':>6} {'sim':>6}  act MiB per rank"
    )
    print(header)
    print("-" * len(header))
    for rec in records:
        predicted = rec.get("predicted") or {}
        peaks = " ".join(f"{b / MIB:7.1f}" for b in rec["peak_activation_bytes"])
        print(
            f"{rec['label']:<32} {rec['microbatches']:>2} {rec['step_time_s']:>7.3f} "
            f"{_fmt(rec.get('step_time_ratio'), '6.3f'):>6} "
            f"{_fmt(predicted.get('step_time_ratio'), '6.3f'):>6} "
            f"{rec['bubble_fraction']:>6.3f} {_fmt(predicted.get('bubble_fraction'), '6.3f'):>6} "
            f"{rec['peak_activation_bytes'][0] / MIB:>10.1f} "
            f"{_fmt(rec.get('peak_activation_ratio'), '6.3f'):>6} "
            f"{_fmt(predicted.get('peak_activation_ratio'), '6.3f'):>6}  {peaks}"
        )


# ---- command line ---------------------------------------------------------------------

@dataclass(frozen=True)
class BenchPreset:
    """Defaults of a run; command-line options override each of them.

    ``microbatches_per_pp``: microbatch counts as multiples of pp.
    ``segments``: k for every Seq1F1B schedule, or None for each one's defaults.
    """

    model: TinyTransformerArgs
    seq_len: int
    microbatches_per_pp: tuple[int, ...]
    segments: tuple[int, ...] | None
    partitions: tuple[str, ...]
    steps: int
    warmup_steps: int


# One step of 1F1B at pp=2, m=2 takes about 1.5 s on one core per rank: large
# enough that compute dominates gloo p2p and Python overheads.
FULL_PRESET = BenchPreset(
    model=TinyTransformerArgs(
        vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=2, ffn_hidden_dim=768,
        attention_backend="sdpa",
    ),
    seq_len=1024,
    microbatches_per_pp=(1, 2),
    segments=None,
    partitions=("uniform", "balanced"),
    steps=5,
    warmup_steps=1,
)
QUICK_PRESET = BenchPreset(
    model=TinyTransformerArgs(
        vocab_size=1024, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384,
        attention_backend="sdpa",
    ),
    seq_len=512,
    microbatches_per_pp=(1,),
    segments=(1, 4),
    partitions=("balanced",),
    steps=2,
    warmup_steps=1,
)


_non_negative_int = number_at_least(int, 0, "an integer >= 0")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.bench",
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
    run.add_argument("--partitions", nargs="+", choices=("uniform", "balanced"),
                     help="segment lengths for k > 1 (default both; --quick: balanced)")
    run.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES),
                     metavar="NAME", help=f"rows to run (default all: {', '.join(SCHEDULES)})")
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
    for k in segments or ():
        if seq_len % k:
            divisors = " ".join(str(d) for d in range(1, 17) if seq_len % d == 0)
            parser.error(
                f"--segments {k} does not divide --seq-len {seq_len}; pick segment counts "
                f"that divide the sequence length (up to 16: {divisors})"
            )
    for name in args.schedules:
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
    return config, plan_rows(args.schedules, microbatches, segments, partitions)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config, rows = _config_from_args(parser, args)
    print(f"running {len(rows)} rows on {config.pp} gloo ranks...", flush=True)
    started = time.perf_counter()
    records = run_bench(config, rows, timeout=args.timeout)
    print_table(config, records)
    print(f"total wall time {time.perf_counter() - started:.1f}s")
    if args.json:
        write_json(parser, args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())

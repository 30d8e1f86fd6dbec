# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a benchmark run measures: the model and repetitions, the rows, and the presets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torchtitan_seq1f1b.examples.tiny_transformer import (
    BENCH_MODEL,
    BENCH_SEQ_LEN,
    TinyTransformerArgs,
)
from torchtitan_seq1f1b.planner import segment_plan, TimeModel
from torchtitan_seq1f1b.segmenting import SegmentPlan
from benchmarks.cpu_bench.schedules import BenchSchedule, SCHEDULES
from torchtitan_seq1f1b.tools.model_shapes import embedding_params, final_norm_params, layer_params

__all__ = [
    "BenchConfig",
    "BenchPreset",
    "BenchRow",
    "FULL_PRESET",
    "QUICK_PRESET",
    "plan_context_rows",
    "plan_rows",
]


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
        time_model: the model's calibrated unit times on this machine (one
            thread): the "time" partition, "auto" rows and calibrated predictions.
    """

    model: TinyTransformerArgs
    seq_len: int
    pp: int
    microbatch_size: int = 1
    steps: int = 5
    warmup_steps: int = 1
    seed: int = 0
    time_model: TimeModel | None = None

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
    """One measured configuration: a schedule, m, and (Seq1F1B) k and partition.

    ``auto``: k and partition are the planner's choice for this schedule and m.
    ``compiled``: every block compiled (``fullgraph=True``), as torchtitan compiles.
    ``cp``: context-parallel degree; each pipeline rank is ``cp`` ranks, each
    running its head-tail share of every segment (Seq1F1B schedules only).
    """

    schedule: str
    microbatches: int
    segments: int = 1
    partition: str | None = None
    auto: bool = False
    compiled: bool = False
    cp: int = 1

    def __post_init__(self):
        if self.cp > 1 and not self.spec.segmented:
            raise ValueError(f"{self.schedule} cannot run context parallelism inside segments")

    @property
    def spec(self) -> BenchSchedule:
        return SCHEDULES[self.schedule]

    def plan(self, config: BenchConfig) -> SegmentPlan:
        return segment_plan(
            self.partition or "uniform",
            config.seq_len,
            self.segments,
            config.model.cost(),
            config.time_model,
            config.model.n_layers,
        )

    def label(self) -> str:
        compiled = " compiled" if self.compiled else ""
        if not self.spec.segmented:
            return f"{self.schedule}{compiled}"
        partition = f" {self.partition}" if self.segments > 1 else ""
        chosen = " (auto)" if self.auto else ""
        context = f" cp={self.cp}" if self.cp > 1 else ""
        return f"{self.schedule} k={self.segments}{partition}{chosen}{compiled}{context}"


def plan_rows(
    schedules: Sequence[str],
    microbatches: Sequence[int],
    segments: Sequence[int] | None,
    partitions: Sequence[str],
    compiled: Sequence[bool] = (False,),
) -> list[BenchRow]:
    """Every row to run, eager and/or compiled; Seq1F1B's k = 1 once (both
    partitions coincide)."""
    rows = []
    for m in microbatches:
        for name in schedules:
            spec = SCHEDULES[name]
            for compile_blocks in compiled:
                if not spec.segmented:
                    rows.append(BenchRow(name, m, compiled=compile_blocks))
                    continue
                for k in segments or spec.default_segments:
                    for partition in partitions if k > 1 else ("uniform",):
                        rows.append(BenchRow(name, m, k, partition, compiled=compile_blocks))
    return rows


def plan_context_rows(
    cp: int, microbatches: Sequence[int], segments: Sequence[int]
) -> list[BenchRow]:
    """The context-parallel comparison: per m, torch's 1F1B and uniform Seq1F1B (each k)
    without CP, then the same Seq1F1B rows at CP degree ``cp``, where k = 1 stands in
    for 1F1B (the same order; torch's schedule cannot run CP inside segments)."""
    rows = []
    for m in microbatches:
        alone = plan_rows(("1F1B", "Seq1F1B"), (m,), segments, ("uniform",))
        rows += alone + [replace(row, cp=cp) for row in alone if row.spec.segmented]
    return rows


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


FULL_PRESET = BenchPreset(
    model=BENCH_MODEL,
    seq_len=BENCH_SEQ_LEN,
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

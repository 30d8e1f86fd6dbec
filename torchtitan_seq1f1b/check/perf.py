# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.check --perf``: a stage's Seq1F1B units on one GPU.

One pipeline rank's stage of a llama3-8B-shaped model (4 blocks: dim 4096,
32 query and 8 K/V heads, FFN 14336, bf16) runs one microbatch at 32k and
64k tokens, cut into k = 1, 2, 4 and 8 FLOP-balanced segments, under every
activation checkpointing mode, with the attention kernel ``auto`` picks. Per
configuration it reports each unit's forward and backward time and peak
memory, the host syncs of a step (``torch.cuda.set_sync_debug_mode``), its
host reads and uploads, and how often attention's forward ran. From each
mode's measured units it predicts a llama3-8B step (32 blocks, 2 x pp
microbatches) under Seq1F1B against 1F1B for pp = 4 and 8 with the simulator.
On CPU (``--device cpu``) the same runs on a small shape, to show what it does.
"""

import contextlib
import dataclasses
import statistics
import time
import warnings
from collections.abc import Iterator

import torch

from torchtitan_seq1f1b.check import Result, run_tasks, Task
from torchtitan_seq1f1b.check.counters import AttentionForwardCounter, HostTransferCounter
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.examples.tiny_transformer import (
    ACTIVATION_CHECKPOINT_MODES,
    TinyTransformer,
    TinyTransformerArgs,
)
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.planner.time_model import fit_unit_time, TimeModel, UnitTime
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost
from torchtitan_seq1f1b.tools.model_shapes import get_preset
from torchtitan_seq1f1b.tools.simulate.config import SimConfig
from torchtitan_seq1f1b.tools.simulate.step import simulate

__all__ = [
    "PerfShape",
    "UnitClock",
    "UnitsMeasured",
    "format_perf",
    "measure_units",
    "perf_group",
    "perf_results",
    "perf_tasks",
    "predicted_speedups",
    "segmented_pass",
]

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class PerfShape:
    """What ``--perf`` runs: a stage of ``blocks`` blocks of ``model``'s dims,
    and the whole ``model`` its step predictions are for."""

    name: str
    model: TransformerCost
    blocks: int
    seq_lens: tuple[int, ...]
    dtype: torch.dtype
    segment_counts: tuple[int, ...] = (1, 2, 4, 8)
    repeats: int = 3
    align: int = 128
    pipeline_sizes: tuple[int, ...] = (4, 8)

    def stage_args(self, mode: str) -> TinyTransformerArgs:
        cost = self.model
        return TinyTransformerArgs(
            vocab_size=1,  # the stage holds neither embedding nor head
            dim=cost.dim,
            n_layers=self.blocks,
            n_heads=cost.n_heads,
            n_kv_heads=cost.n_kv_heads,
            ffn_hidden_dim=cost.ffn_hidden_dim,
            rope_theta=500000.0,
            activation_checkpoint=mode,
        )

    def stage(self, mode: str, device: torch.device) -> TinyTransformer:
        """The stage's blocks in ``dtype`` (seed 0), without embedding and head:
        hidden states (batch, seq_len, dim) at positions (1, seq_len) -> same shape."""
        torch.manual_seed(0)
        with torch.device(device):
            model = TinyTransformer(self.stage_args(mode))
        model.tok_embeddings = model.norm = model.output = None
        return model.to(self.dtype)


GPU_SHAPE = PerfShape(
    "llama3-8b", get_preset("llama3-8b"), blocks=4, seq_lens=(32768, 65536), dtype=torch.bfloat16
)
CPU_SHAPE = PerfShape(
    "a small llama",
    TransformerCost(
        n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=256,
        gated_mlp=True,
    ),
    blocks=2, seq_lens=(256,), dtype=torch.float32, repeats=1, align=8, pipeline_sizes=(2,),
)


@dataclasses.dataclass
class UnitsMeasured:
    """One microbatch of one configuration; times in seconds, memory in MiB.

    ``forward[j]``/``backward[j]``: segment j's median time. ``peak_mib[j]``:
    the most allocated during segment j's forward or backward (CUDA only).
    ``syncs``: host syncs CUDA reported in a step (None off CUDA).
    """

    seq_len: int
    mode: str
    plan: SegmentPlan
    forward: list[float] = dataclasses.field(default_factory=list)
    backward: list[float] = dataclasses.field(default_factory=list)
    peak_mib: list[float] = dataclasses.field(default_factory=list)
    syncs: int | None = None
    host_reads: int = 0
    uploads: int = 0
    attention_forwards: int = 0
    error: str = ""


class UnitClock:
    """Per-unit device time (CUDA events, no sync between units) or wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.spans: list[tuple] = []
        self.peaks: list[float] = []

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
            self.peaks.append(torch.cuda.max_memory_allocated(self.device) / MIB)
        else:
            started = time.perf_counter()
            yield
            self.spans.append((started, time.perf_counter()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1e3 for start, end in self.spans]
        return [end - start for start, end in self.spans]


def segmented_pass(model, x, grad, plan, clock: UnitClock | None = None) -> SegmentedRun:
    """One microbatch x (batch, seq_len, dim) through ``model`` segment by segment,
    back-propagating ``grad`` (x's shape); ``clock`` times each unit. Returns the
    run (its outputs and input gradients), the store freed."""
    run = SegmentedRun(model, [x], plan, KVStore(), positions_kwarg="positions")
    timed = clock.unit if clock is not None else contextlib.nullcontext
    for segment in range(plan.num_segments):
        with timed():
            run.forward(segment)
    # CUDA runs backward on its device thread; on CPU a fresh thread stands in.
    with backward_on_fresh_thread(enabled=x.device.type != "cuda"):
        for segment in reversed(range(plan.num_segments)):
            with timed():
                run.backward(segment, grad)
    run.store.free(run.microbatch)
    return run


@contextlib.contextmanager
def _syncs_reported(device: torch.device) -> Iterator[list]:
    """Warnings CUDA's sync debug mode raises for each host sync while active."""
    if device.type != "cuda":
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def measure_units(
    shape: PerfShape, seq_len: int, mode: str, k: int, device: torch.device
) -> UnitsMeasured:
    """Warm-up, one counted step, then ``shape.repeats`` timed steps of one configuration."""
    args = shape.stage_args(mode)
    plan = (
        SegmentPlan.uniform(seq_len, 1)
        if k == 1
        else SegmentPlan.balanced(seq_len, k, args.cost(), shape.align)
    )
    measured = UnitsMeasured(seq_len, mode, plan)
    model = shape.stage(mode, device)
    x = torch.randn(1, seq_len, args.dim, device=device, dtype=shape.dtype)
    grad = torch.randn_like(x)
    try:
        segmented_pass(model, x, grad, plan)
        model.zero_grad(set_to_none=True)
        with AttentionForwardCounter() as attention, HostTransferCounter() as host:
            with _syncs_reported(device) as syncs:
                segmented_pass(model, x, grad, plan)
        measured.attention_forwards = attention.count
        measured.host_reads, measured.uploads = host.reads, host.uploads
        measured.syncs = len(syncs) if device.type == "cuda" else None
        passes = []
        for _ in range(shape.repeats):
            model.zero_grad(set_to_none=True)
            clock = UnitClock(device)
            segmented_pass(model, x, grad, plan, clock)
            passes.append(clock.seconds())
        per_unit = [statistics.median(times) for times in zip(*passes)]
        measured.forward, backward = per_unit[:k], per_unit[k:]
        measured.backward = backward[::-1]  # segment order
        if clock.peaks:  # the last pass's, per unit in segment order
            fwd, bwd = clock.peaks[:k], clock.peaks[k:][::-1]
            measured.peak_mib = [max(f, b) for f, b in zip(fwd, bwd)]
    except torch.OutOfMemoryError:
        measured.error = "out of memory"
    finally:
        del model, x, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return measured


def _time_model(shape: PerfShape, runs: list[UnitsMeasured]) -> TimeModel:
    """A block's F and B unit times fitted to one mode's measured units (the head is not timed)."""
    samples = {"F": [], "B": []}
    for run in runs:
        for kind, times in (("F", run.forward), ("B", run.backward)):
            samples[kind] += [
                (n, end, t / shape.blocks) for n, end, t in zip(run.plan.lengths, run.plan.ends, times)
            ]
    nothing = UnitTime(0.0, 0.0, 0.0)
    return TimeModel(
        block={kind: fit_unit_time(s) for kind, s in samples.items()},
        head={"F": nothing, "B": nothing},
        block_activation_bytes=0.0,
        head_activation_bytes=0.0,
        kv_bytes=0.0,
        kv_grad_bytes=0.0,
    )


def predicted_speedups(shape: PerfShape, runs: list[UnitsMeasured]) -> dict[int, dict[int, float]]:
    """Per k > 1 of ``runs`` and per pp, 1F1B's predicted step time over Seq1F1B's for
    ``shape.model``, from one time model fitted to all of ``runs`` (one mode's)."""
    model = _time_model(shape, runs)
    speedups: dict[int, dict[int, float]] = {}
    for pp in shape.pipeline_sizes:
        common = dict(
            model=shape.model, seq_len=runs[0].seq_len, pp=pp,
            microbatches=2 * pp, time_model=model, align=shape.align,
        )
        one_f_one_b = simulate(SimConfig(schedule="1F1B", **common)).makespan
        for run in runs:
            k = run.plan.num_segments
            if k > 1:
                seq1f1b = simulate(SimConfig(schedule="Seq1F1B", segments=k, **common)).makespan
                speedups.setdefault(k, {})[pp] = one_f_one_b / seq1f1b
    return speedups


def _row_name(seq_len: int, mode: str, k: int) -> str:
    return f"perf {seq_len} ac={mode} k={k}"


def perf_group(shape: PerfShape, seq_len: int, mode: str, device: torch.device) -> list[dict]:
    """One row per k of one sequence length and checkpointing mode: the measured
    units (:class:`UnitsMeasured` as a dict, ``plan`` its lengths), ``k`` and
    ``speedup`` ({pp: predicted 1F1B / Seq1F1B step time}, empty for k = 1 or an error)."""
    runs = [measure_units(shape, seq_len, mode, k, device) for k in shape.segment_counts]
    fitted = [run for run in runs if not run.error]
    speedups = predicted_speedups(shape, fitted) if len(fitted) > 1 else {}
    return [
        {
            **dataclasses.asdict(run),
            "plan": list(run.plan.lengths),
            "k": k,
            "speedup": speedups.get(k, {}) if not run.error else {},
        }
        for k, run in zip(shape.segment_counts, runs)
    ]


def perf_results(device: torch.device, shape: PerfShape | None = None) -> list[dict]:
    """Every configuration of ``shape`` (default: the GPU shape on CUDA, a small one on CPU)."""
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    return [row.measured for row in run_tasks(perf_tasks(device, shape))]


def _group_task(shape: PerfShape, seq_len: int, mode: str, device: torch.device) -> Task:
    def run() -> list[Result]:
        results = []
        for row in perf_group(shape, seq_len, mode, device):
            status = "skip" if row["error"] else "pass"  # out of memory: not this device's to run
            results.append(Result(_row_name(seq_len, mode, row["k"]), status, row, row["error"]))
        return results

    return Task(tuple(_row_name(seq_len, mode, k) for k in shape.segment_counts), run)


def perf_tasks(device: torch.device, shape: PerfShape) -> list[Task]:
    """One task per (sequence length, checkpointing mode): its rows share a time model.
    A row passes when measured, is skipped when out of memory; its ``measured`` is
    :func:`perf_group`'s row."""
    return [
        _group_task(shape, seq_len, mode, device)
        for seq_len in shape.seq_lens
        for mode in ACTIVATION_CHECKPOINT_MODES
    ]


def format_perf(rows: list[dict], shape: PerfShape) -> str:
    """One table: a row per (sequence, checkpointing mode, k) of :func:`perf_group`'s rows."""
    pps = shape.pipeline_sizes
    header = (
        f"{'seq':>6} {'ac':<15} {'k':>2} {'F ms':>9} {'B ms':>9} {'peak GiB':>8} "
        f"{'syncs':>5} {'reads':>5} {'attn fwd':>8} "
        + " ".join(f"{f'pp{pp} vs 1F1B':>12}" for pp in pps)
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        head = f"{row['seq_len']:>6} {row['mode']:<15} {row['k']:>2} "
        if row["error"]:
            lines.append(head + row["error"])
            continue
        peak = f"{max(row['peak_mib']) / 1024:.1f}" if row["peak_mib"] else "n/a"
        syncs = "n/a" if row["syncs"] is None else str(row["syncs"])
        speedup = row["speedup"]
        lines.append(
            head
            + f"{sum(row['forward']) * 1e3:>9.1f} {sum(row['backward']) * 1e3:>9.1f} {peak:>8} "
            f"{syncs:>5} {row['host_reads']:>5} {row['attention_forwards']:>8} "
            + " ".join(f"{f'{speedup[pp]:.3f}x' if pp in speedup else '-':>12}" for pp in pps)
        )
    lines.append(
        f"F/B: one microbatch's forwards/backwards over {shape.blocks} blocks, summed over its "
        f"k units, median of {shape.repeats} timed steps; peak: the most allocated during a "
        "unit; pp columns: predicted 1F1B step time / Seq1F1B's "
        f"({shape.name}, 2 x pp microbatches, LM head not timed)"
    )
    return "\n".join(lines)

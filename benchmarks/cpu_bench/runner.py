# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run the rows on local gloo ranks: build each row's stages and schedule, step, measure."""

from __future__ import annotations

import ctypes
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from torchtitan_seq1f1b._torch_compat.introspection import timed_p2p_waits
from torchtitan_seq1f1b.context_parallel import ContextGroup, HeadTail
from torchtitan_seq1f1b.local_ranks import run_ranks
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformer, token_sum_cross_entropy
from benchmarks.planner_probes.compute_spans import ComputeRecorder
from benchmarks.cpu_bench.config import BenchConfig, BenchRow
from benchmarks.cpu_bench.predict import add_comparisons
from benchmarks.cpu_bench.probes import ActivationMemoryProbe
from benchmarks.cpu_bench.records import RankRun, row_record, StepTiming
from benchmarks.cpu_bench.traffic import TrafficCounter

__all__ = ["run_bench"]


def _batch(config: BenchConfig, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded tokens and targets: (microbatches * microbatch_size, seq_len)."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    shape = (microbatches * config.microbatch_size, config.seq_len)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    target = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    return tokens, target


def _build_schedule(
    row: BenchRow, stages: list[PipelineStage], config: BenchConfig, context: ContextGroup | None
):
    spec = row.spec
    if spec.segmented:
        return spec.schedule_cls(
            stages,
            row.microbatches,
            row.plan(config),
            loss_fn=token_sum_cross_entropy,
            positions_kwarg="positions",
            context_parallel=context,
        )
    if issubclass(spec.schedule_cls, PipelineScheduleSingle):
        return spec.schedule_cls(stages[0], row.microbatches, loss_fn=token_sum_cross_entropy)
    return spec.schedule_cls(stages, row.microbatches, loss_fn=token_sum_cross_entropy)


def _mesh(
    rank: int, pp: int, cp: int
) -> tuple[int, dist.ProcessGroup | None, ContextGroup | None]:
    """(pipeline rank, pipeline group, CP group) of ``rank``, PP outermost as torchtitan's mesh
    lays ranks out: rank = pp_rank * cp + cp_rank. Without CP: the default group, no CP group."""
    if cp == 1:
        return rank, None, None
    # Every rank creates every group, in the same order.
    pp_groups = [dist.new_group([p * cp + c for p in range(pp)]) for c in range(cp)]
    cp_groups = [dist.new_group([p * cp + c for c in range(cp)]) for p in range(pp)]
    pp_rank, cp_rank = divmod(rank, cp)
    return pp_rank, pp_groups[cp_rank], ContextGroup(HeadTail(cp, cp_rank), cp_groups[pp_rank])


class _RankRow:
    """One row's stages and schedule on this rank, ready to step.

    ``rank`` is the pipeline rank in ``pp_group`` (the default group if None);
    ``context`` the CP group, for rows with ``row.cp > 1``.
    """

    def __init__(
        self, rank: int, pp: int, model: TinyTransformer, config: BenchConfig, row: BenchRow,
        pp_group: dist.ProcessGroup | None, context: ContextGroup | None,
    ):
        spec = row.spec
        num_stages = pp * spec.stages_per_rank
        indices = spec.stage_indices(rank, pp)
        self.parts = [model.stage(i, num_stages, compile_blocks=row.compiled) for i in indices]
        self.stages = [
            PipelineStage(part, i, num_stages, torch.device("cpu"), group=pp_group)
            for part, i in zip(self.parts, indices)
        ]
        self.schedule = _build_schedule(row, self.stages, config, context)
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

    def measure(self) -> tuple[ActivationMemoryProbe, TrafficCounter]:
        """Activation memory and bytes communicated over one step."""
        # Its own step: saved-tensor hooks cost time the timed steps should not pay.
        with (
            ActivationMemoryProbe(self.parts, self.kv_stores) as probe,
            TrafficCounter() as traffic,
        ):
            self.synchronised_step()
        return probe, traffic


# glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's cap on 64-bit hosts


def _keep_freed_memory_mapped() -> None:
    """Keep freed heap pages in this process instead of returning them to the OS (glibc).

    A job repeats one step, so its allocations find their pages again; the
    bench interleaves rows, and without this a row after one that holds less
    memory would pay page faults for every page it touches first. Blocks over
    glibc's 32 MiB cap are still mapped apart and returned (the bench model's
    tensors are all smaller).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        return
    settings = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1))
    if not all(mallopt(option, value) == 1 for option, value in settings):
        warnings.warn(
            "the allocator refused to keep freed pages: rows may pay page faults for their "
            "neighbours' memory",
            stacklevel=2,
        )


def _rank_worker(
    rank: int, world_size: int, config: BenchConfig, rows: list[BenchRow]
) -> list[RankRun]:
    """Every row on this rank, from the same initial weights (each row copies its stages).

    The rows share one CP degree, ``world_size / config.pp``. Steps go
    round-robin over the rows, so a machine that slows down for a while
    (shared or virtual CPUs) slows every row alike instead of a few.
    """
    _keep_freed_memory_mapped()
    pp_rank, pp_group, context = _mesh(rank, config.pp, world_size // config.pp)
    torch.manual_seed(config.seed)
    model = TinyTransformer(config.model)
    prepared = [
        _RankRow(pp_rank, config.pp, model, config, row, pp_group, context) for row in rows
    ]
    # The first step of a compiled row includes compiling its blocks.
    first_steps = [0.0] * len(rows)
    for step in range(config.warmup_steps):
        for i, row in enumerate(prepared):
            timing = row.synchronised_step()
            if step == 0:
                first_steps[i] = timing.seconds
    timings: list[list[StepTiming]] = [[] for _ in rows]
    for _ in range(config.steps):
        for row, steps in zip(prepared, timings):
            steps.append(row.synchronised_step())
    runs = []
    for row, steps, first in zip(prepared, timings, first_steps):
        probe, traffic = row.measure()
        runs.append(RankRun(
            steps, probe.peak_bytes, probe.peak_saved_bytes, probe.peak_kv_bytes,
            traffic.bytes, traffic.calls, first,
        ))
    return runs


def run_bench(config: BenchConfig, rows: list[BenchRow], timeout: float = 3600) -> list[dict]:
    """Run every row on ``config.pp * row.cp`` local gloo ranks (one launch per CP degree);
    one record per row, in the order of ``rows``."""
    records: list[dict | None] = [None] * len(rows)
    for cp in dict.fromkeys(row.cp for row in rows):
        indices = [i for i, row in enumerate(rows) if row.cp == cp]
        world_size = config.pp * cp
        per_rank = run_ranks(
            _rank_worker, world_size, config, [rows[i] for i in indices], timeout=timeout
        )
        for j, i in enumerate(indices):
            records[i] = row_record(config, rows[i], [per_rank[r][j] for r in range(world_size)])
    add_comparisons(config, rows, records)
    return records

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The segment plan a job's ``seq1f1b`` options ask for, whichever torchtitan runs it.

Each adapter reads the options, ``training.seq_len``, the tensor-parallel
degree and the model's dims out of its release's config and model; the plan
itself depends on nothing torchtitan-specific. ``num_segments = "auto"`` and
the "time" and "auto" partitions run the calibrated planner
(:mod:`torchtitan_seq1f1b.planner`) on rank 0, which tells every rank its
choice, so all ranks cut sequences alike.
"""

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_seq1f1b._torch_compat.process_group_store import default_store
from torchtitan_seq1f1b.integration.options import Seq1F1BOptions
from torchtitan_seq1f1b.planner import (
    AutoPlanRequest,
    GIB,
    NoPlanFitsError,
    PARTITIONS,
    plan_automatically,
)
from torchtitan_seq1f1b.planner.auto import OrderFor
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = [
    "PlannerJob",
    "Seq1F1BConfigError",
    "plan_align",
    "plan_segments",
    "planner_problems",
    "sequence_shards",
    "uses_planner",
]

# Parameters, gradients and Adam's two moments, all fp32.
_STATE_BYTES_PER_PARAMETER = 16
PLANNER_WAIT = timedelta(hours=4)
"""How long ranks wait for rank 0's calibration (long sequences on a slow device)."""
_PLANNER_CALLS = itertools.count()


class Seq1F1BConfigError(ValueError):
    """A job config Seq1F1B cannot run, found before any collective."""


@dataclass(frozen=True)
class PlannerJob:
    """What the planner needs from a job besides its options.

    Args:
        num_ranks: pipeline ranks.
        stages_per_rank: stages on every rank.
        microbatches: microbatches per step.
        order_for: the schedule class's ``order_for``.
        device: where this rank computes (calibration runs there on rank 0).
        dtype: the compute dtype of activations.
        microbatch_size: sequences per microbatch.
        parameters: parameters this rank holds (for the default memory budget).
        state_shards: how many ranks share each parameter's states (FSDP).
    """

    num_ranks: int
    stages_per_rank: int
    microbatches: int
    order_for: OrderFor
    device: torch.device
    dtype: torch.dtype
    microbatch_size: int
    parameters: int
    state_shards: int = 1

    @classmethod
    def for_stages(
        cls,
        model: nn.Module,
        module_names_per_stage: list[list[str]],
        parallel_dims: Any,
        schedule_class: type[ScheduleSeq1F1B],
        microbatch_size: int,
        n_microbatches: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> "PlannerJob":
        """The job that splits ``model`` into ``module_names_per_stage`` over
        ``parallel_dims.pp`` ranks (torchtitan's ``ParallelDims``, any release)."""
        num_ranks = parallel_dims.pp
        return cls(
            num_ranks=num_ranks,
            stages_per_rank=len(module_names_per_stage) // num_ranks,
            microbatches=n_microbatches,
            order_for=schedule_class.order_for,
            device=torch.device(device),
            dtype=dtype,
            microbatch_size=microbatch_size,
            parameters=_heaviest_rank_parameters(model, module_names_per_stage, num_ranks),
            state_shards=parallel_dims.dp_shard if parallel_dims.fsdp_enabled else 1,
        )

    def free_bytes(self) -> int:
        """Memory left on this rank's device for activations and K/V."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // local_ranks
        states = self.parameters * _STATE_BYTES_PER_PARAMETER // self.state_shards
        return free - states


def _heaviest_rank_parameters(
    model: nn.Module, module_names_per_stage: list[list[str]], num_ranks: int
) -> int:
    """Parameters of the largest stage times stages per rank: a bound on any rank's share.

    ``model`` may be on the meta device; names are its submodules', per stage.
    """
    per_stage = [
        sum(p.numel() for name in names for p in model.get_submodule(name).parameters())
        for names in module_names_per_stage
    ]
    return max(per_stage) * (len(per_stage) // num_ranks)


def uses_planner(options: Seq1F1BOptions) -> bool:
    """Whether the options leave k or the partition to the calibrated planner."""
    return options.num_segments == "auto" or options.partition in ("time", "auto")


def planner_problems(options: Seq1F1BOptions) -> list[str]:
    """What is wrong with the planner options, found from the config alone."""
    problems = []
    if options.partition not in (*PARTITIONS, "auto"):
        problems.append(
            f"seq1f1b.partition={options.partition!r} must be one of {(*PARTITIONS, 'auto')}"
        )
    budget = options.memory_budget_gib
    if budget is not None and not budget > 0:
        problems.append(f"seq1f1b.memory_budget_gib={budget} must be > 0 (or unset)")
    if options.segment_lengths and uses_planner(options):
        problems.append(
            f"seq1f1b.segment_lengths={options.segment_lengths} fixes the plan, but "
            f"num_segments={options.num_segments!r} / partition={options.partition!r} ask the "
            "planner for one; drop segment_lengths or set an integer num_segments and "
            "partition 'balanced' or 'uniform'"
        )
    return problems


def sequence_shards(tp: int, cp: int) -> int:
    """What every segment length must be a multiple of for the job's sequence
    sharding: ``tp`` (sequence parallel), times 2 * ``cp`` under context
    parallelism (each CP rank holds two head-tail pieces), as torchtitan asks of
    ``training.seq_len``."""
    return tp * (2 * cp if cp > 1 else 1)


def plan_align(options: Seq1F1BOptions, seq_len: int, tp: int, cp: int, on_cuda: bool) -> int:
    """What every segment length of the job is a multiple of: ``seq1f1b.align``
    (:meth:`Seq1F1BOptions.segment_align`) and :func:`sequence_shards`. Raises ValueError
    on a bad ``align``."""
    return math.lcm(options.segment_align(1, seq_len, on_cuda), sequence_shards(tp, cp))


def plan_segments(
    options: Seq1F1BOptions,
    seq_len: int,
    tp: int,
    cost: TransformerCost,
    job: PlannerJob | None = None,
    log: Callable[[str], None] = print,
    cp: int = 1,
    length_option: str = "training.seq_len",
) -> SegmentPlan:
    """The plan ``options`` ask for at ``seq_len`` tokens per sequence (the option
    ``length_option``, which errors name).

    Segment lengths are multiples of :meth:`Seq1F1BOptions.segment_align` (the
    kernel tile on CUDA unless ``align`` is set) and of :func:`sequence_shards`
    (sequence parallel shards every segment over the TP ranks, context
    parallelism cuts it into 2 * ``cp`` pieces); ``cost`` prices
    segments for the "balanced" partition. Options that use the planner need
    ``job`` and, under torch.distributed, every rank calling together. Raises
    :class:`Seq1F1BConfigError` naming the options when no such plan exists.
    """
    try:
        chosen = options.segment_align(1, seq_len, torch.cuda.is_available())
    except ValueError as error:
        raise Seq1F1BConfigError(str(error)) from None
    align = math.lcm(chosen, sequence_shards(tp, cp))
    context = f" x 2 * cp={cp}" if cp > 1 else ""
    where = (
        f"seq1f1b.num_segments={options.num_segments!r}, seq1f1b.partition="
        f"{options.partition!r}, seq1f1b.align={chosen} (x tp={tp}{context}), "
        f"{length_option}={seq_len}"
    )
    try:
        if options.segment_lengths:
            if sum(options.segment_lengths) != seq_len:
                raise ValueError(
                    f"seq1f1b.segment_lengths={options.segment_lengths} sum to "
                    f"{sum(options.segment_lengths)}, not {seq_len}"
                )
            return SegmentPlan.from_lengths(options.segment_lengths, align)
        if options.num_segments != "auto" and options.num_segments * align > seq_len:
            raise ValueError(
                f"{options.num_segments} segments of at least {align} tokens do not "
                f"fit in {seq_len}; lower num_segments or align"
            )
        if uses_planner(options):
            if job is None:
                raise ValueError("the planner needs the job's layout (PlannerJob)")
            return _planned(options, seq_len, align, cost, job, log, cp)
        if options.partition == "uniform":
            return SegmentPlan.uniform(seq_len, options.num_segments, align)
        return SegmentPlan.balanced(seq_len, options.num_segments, cost, align)
    except ValueError as error:
        raise Seq1F1BConfigError(f"{where}: {error}") from None


def _planned(
    options: Seq1F1BOptions,
    seq_len: int,
    align: int,
    cost: TransformerCost,
    job: PlannerJob,
    log: Callable[[str], None],
    cp: int,
) -> SegmentPlan:
    """Rank 0 calibrates and chooses; every rank gets its lengths (or its error)."""
    distributed = dist.is_available() and dist.is_initialized()
    if options.memory_budget_gib is not None:
        budget = int(options.memory_budget_gib * GIB)
    else:
        free = job.free_bytes()
        budgets = [free]
        if distributed:
            budgets = [None] * dist.get_world_size()
            dist.all_gather_object(budgets, free)
        budget = min(budgets)
    outcome = [None]
    done = f"seq1f1b/planner/{next(_PLANNER_CALLS)}"
    if not distributed or dist.get_rank() == 0:
        try:
            outcome = [_choose(options, seq_len, align, cost, job, budget, cp)]
        except Exception as error:  # noqa: BLE001 - the other ranks wait for it
            failure = f"the planner failed on rank 0: {type(error).__name__}: {error}"
            outcome = [(None, None, failure)]
        if distributed:
            default_store().set(done, "1")
    if distributed:
        # Calibrating long sequences outlasts a collective's timeout (torchtitan's
        # comm.init_timeout_seconds): wait on the store, which has its own.
        default_store().wait([done], PLANNER_WAIT)
        dist.broadcast_object_list(outcome, src=0)
    lengths, report, error = outcome[0]
    if error is not None:
        raise ValueError(error)
    log(report)
    return SegmentPlan.from_lengths(lengths, align)


def _choose(
    options: Seq1F1BOptions,
    seq_len: int,
    align: int,
    cost: TransformerCost,
    job: PlannerJob,
    budget: int,
    cp: int,
) -> tuple[tuple[int, ...] | None, str | None, str | None]:
    """(lengths, what to log, None), or (None, None, the error) for every rank to raise."""
    partitions = PARTITIONS if options.partition == "auto" else (options.partition,)
    counts = range(1, 17) if options.num_segments == "auto" else (options.num_segments,)
    request = AutoPlanRequest(
        shape=cost,
        seq_len=seq_len,
        num_ranks=job.num_ranks,
        stages_per_rank=job.stages_per_rank,
        microbatches=job.microbatches,
        order_for=job.order_for,
        align=align,
        device=str(job.device),
        dtype=job.dtype,
        microbatch_size=job.microbatch_size,
        attention_backend=options.attention_backend,
        budget_bytes=budget,
        partitions=partitions,
        segment_counts=tuple(counts),
        context_parallel=cp,
    )
    try:
        chosen = plan_automatically(request)
    except NoPlanFitsError as error:
        if options.memory_budget_gib is not None:
            return None, None, f"seq1f1b.memory_budget_gib={options.memory_budget_gib:g}: {error}"
        return None, None, (
            f"seq1f1b.memory_budget_gib unset, so the budget is the least free memory of any "
            f"rank after its parameters, gradients and Adam states ({budget / GIB:.3f} GiB): "
            f"{error}; set seq1f1b.memory_budget_gib to give another"
        )
    best = chosen.recommendation.best
    report = (
        f"Seq1F1B planner (time model {chosen.calibration_source}; "
        f"{chosen.time_model.describe()}): k={best.num_segments} "
        f"{best.partition}, lengths {list(best.plan.lengths)}, predicted step "
        f"{best.step_seconds:.4f} s, bubble {best.bubble_fraction:.3f}, peak activations + "
        f"K/V per rank {[round(b / GIB, 3) for b in best.peak_bytes]} GiB within "
        f"{budget / GIB:.3f} GiB; best plans:\n{chosen.recommendation.table(5)}"
    )
    return best.plan.lengths, report, None

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the pipeline runtime itself costs per action, measured through it on two local ranks.

Between two compute calls a rank's runtime walks its schedule, posts and
waits on the unit's messages, cuts inputs and targets, enters the K/V scope
and, on the last stage, computes the loss. The unit calibration times compute
calls alone, so this part is measured apart: two gloo ranks run
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1B` and
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1BZBV` over stages whose
compute is one elementwise product, with the job's hidden-state shape and
dtype, at k = 1, 2, 4, 8 and 16. A probe's step is then almost all runtime,
and replaying its order with a constant cost per action (and per token of the
action's segment, for the messages' bytes) says what the step should take.
The fit of :class:`RuntimeOverhead` makes the two agree.

Each probe keeps the median of its steps (and each step the slower rank's
time); probes run round-robin so a slow stretch of the host spreads over all
of them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_seq1f1b.actions import Order, Unit
from torchtitan_seq1f1b.local_ranks import run_ranks
from torchtitan_seq1f1b.orders import replay
from benchmarks.planner_probes.compute_spans import ComputeRecorder
from benchmarks.planner_probes.probe_pipeline import probe_pipeline
from torchtitan_seq1f1b.planner.time_model import (
    fit_nonnegative,
    PROBED_SEGMENT_COUNTS,
    RuntimeOverhead,
)
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B, ScheduleSeq1F1BZBV
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["measure_runtime_overhead"]

_PROBE_SCHEDULES = (ScheduleSeq1F1B, ScheduleSeq1F1BZBV)
_PROBE_RANKS = 2
_PROBE_MICROBATCHES = 2
_WARMUP_STEPS = 2
_STEPS = 15


class _ElementwiseStage(nn.Module):
    """A stage that costs next to nothing: (batch, len, dim) -> (batch, len, dim)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return h * self.scale


def _output_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.float().sum()


def _probe_rank(
    rank: int,
    world_size: int,
    hidden: tuple[int, int, int],
    dtype: torch.dtype,
    probes: list[tuple[int, int]],
    record_calls: bool,
) -> tuple[list[list[float]], list[tuple[int, float]]]:
    """Step every probe (schedule index, k) on this rank: each probe's step seconds, and, when
    ``record_calls``, the (segment length, seconds) of every compute call (else none: the
    recorder's wrappers would be timed as runtime)."""
    batch, seq_len, dim = hidden
    runs = [
        probe_pipeline(
            _PROBE_SCHEDULES[schedule_index],
            rank,
            world_size,
            _stages_per_rank(_PROBE_SCHEDULES[schedule_index]),
            _PROBE_MICROBATCHES,
            SegmentPlan.uniform(seq_len, k),
            lambda index, num_stages: _ElementwiseStage(),
            _output_sum,
            (batch, dim),
            dtype,
        )
        for schedule_index, k in probes
    ]
    seconds: list[list[float]] = [[] for _ in probes]
    calls: list[tuple[int, float]] = []
    for step in range(_WARMUP_STEPS + _STEPS):
        for pipeline, found in zip(runs, seconds):
            dist.barrier()
            recorded = pipeline.stages if record_calls else []
            with ComputeRecorder(recorded) as recorder:
                start = time.perf_counter()
                pipeline.step()
                took = time.perf_counter() - start
            if step < _WARMUP_STEPS:
                continue
            found.append(took)
            plan = pipeline.schedule.segment_plan
            for span in recorder.spans:
                segment = Unit.of_chunk(span.chunk, plan.num_segments).segment
                calls.append((plan.lengths[segment], span.end - span.start))
    return seconds, calls


def _stages_per_rank(schedule_cls: type) -> int:
    return 2 if schedule_cls is ScheduleSeq1F1BZBV else 1


def _probe_order(schedule_cls: type, k: int) -> Order:
    """The probe's per-rank order; which stages a rank holds is read from it."""
    return schedule_cls.order_for(
        _PROBE_RANKS, _stages_per_rank(schedule_cls), _PROBE_MICROBATCHES, k
    )


def _critical_path(schedule_cls: type, seq_len: int, k: int) -> dict[str, float]:
    """A probe's step as multiples of the overhead's terms: the actions and tokens on its
    replayed critical path, and one step."""
    order = _probe_order(schedule_cls, k)
    lengths = SegmentPlan.uniform(seq_len, k).lengths
    return {
        "per_action": replay(order, lambda action: 1.0).makespan,
        "per_token": replay(order, lambda action: float(lengths[action.segment])).makespan,
        "per_step": 1.0,
    }


def measure_runtime_overhead(
    seq_len: int,
    dim: int,
    microbatch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    outside_calls: bool = False,
) -> RuntimeOverhead:
    """Fit :class:`RuntimeOverhead` to probes of the runtime on two local gloo ranks.

    The probes carry hidden states (``microbatch_size``, segment, ``dim``) in
    ``dtype`` on the CPU: the overhead of ranks that compute on the host.
    ``outside_calls`` leaves out what the runtime spends inside the stages'
    compute calls (torch's and the unit scope's bookkeeping around the
    compute), fitted to the probes' calls the same way: units timed as whole
    calls inside pipeline steps (:mod:`.pipeline_units`) already hold it.
    """
    probes = [
        (s, k) for s in range(len(_PROBE_SCHEDULES)) for k in PROBED_SEGMENT_COUNTS if k <= seq_len
    ]
    per_rank = run_ranks(
        _probe_rank,
        _PROBE_RANKS,
        (microbatch_size, seq_len, dim),
        dtype,
        probes,
        outside_calls,
        timeout=600,
    )
    columns: dict[str, list[float]] = {"per_action": [], "per_token": [], "per_step": []}
    seconds = []
    for i, (schedule_index, k) in enumerate(probes):
        steps = zip(*(rank_seconds[i] for rank_seconds, _ in per_rank))
        seconds.append(statistics.median(max(step) for step in steps))
        for term, value in _critical_path(_PROBE_SCHEDULES[schedule_index], seq_len, k).items():
            columns[term].append(value)
    overhead = RuntimeOverhead(**fit_nonnegative(columns, seconds))
    if not outside_calls:
        return overhead
    return _without_calls(overhead, [call for _, calls in per_rank for call in calls])


def _without_calls(overhead: RuntimeOverhead, calls: list[tuple[int, float]]) -> RuntimeOverhead:
    """``overhead`` less a fit of ``per_action + per_token * length`` to the compute calls'
    (segment length, seconds), each term kept at 0 or above."""
    inside = fit_nonnegative(
        {"per_action": [1.0] * len(calls), "per_token": [float(n) for n, _ in calls]},
        [seconds for _, seconds in calls],
    )
    return RuntimeOverhead(
        per_action=max(overhead.per_action - inside["per_action"], 0.0),
        per_token=max(overhead.per_token - inside["per_token"], 0.0),
        per_step=overhead.per_step,
    )

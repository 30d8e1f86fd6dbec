# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The runtime's cost per action: its probes, its fit and what the estimate charges for it."""

import importlib

import pytest

from benchmarks.planner_probes.runtime_overhead import measure_runtime_overhead
from torchtitan_seq1f1b.orders import replay
from torchtitan_seq1f1b.planner import (
    estimate,
    PipelineShape,
    RuntimeOverhead,
    TimeModel,
    UnitTime,
)
from torchtitan_seq1f1b.planner.time_model import fit_nonnegative, PROBED_SEGMENT_COUNTS
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B, ScheduleSeq1F1BZBV
from torchtitan_seq1f1b.segmenting import SegmentPlan

_probes = importlib.import_module("benchmarks.planner_probes.runtime_overhead")


def _free_compute(runtime: RuntimeOverhead) -> TimeModel:
    """Units that cost nothing, so a step is all runtime."""
    free = UnitTime(0.0, 0.0, 0.0)
    return TimeModel(
        block=dict.fromkeys("FBIW", free),
        head=dict.fromkeys("FBIW", free),
        block_activation_bytes=1.0,
        head_activation_bytes=1.0,
        kv_bytes=1.0,
        kv_grad_bytes=1.0,
        runtime=runtime,
    )


def test_probe_critical_paths_count_the_replayed_actions():
    # Seq1F1B at p = 2, m = 2, k = 1 is 1F1B: F F on stage 0, F B F B on stage 1, B B on
    # stage 0, with stage 0's second F running beside stage 1's first: 6 actions in a row.
    assert _probes._critical_path(ScheduleSeq1F1B, 64, 1) == {
        "per_action": 6.0,
        "per_token": 6.0 * 64,
        "per_step": 1.0,
    }
    # The V runs F, I and W on two stages per rank: longer than its 12 actions per rank.
    zbv = _probes._critical_path(ScheduleSeq1F1BZBV, 64, 4)
    assert zbv["per_action"] > 4 * 12
    assert zbv["per_token"] == zbv["per_action"] * 16


def test_fit_recovers_a_known_overhead_from_the_probes():
    truth = RuntimeOverhead(per_action=4e-4, per_token=3e-7, per_step=2e-3)
    columns: dict[str, list[float]] = {"per_action": [], "per_token": [], "per_step": []}
    seconds = []
    for schedule_cls in _probes._PROBE_SCHEDULES:
        for k in PROBED_SEGMENT_COUNTS:
            path = _probes._critical_path(schedule_cls, 1024, k)
            for term, value in path.items():
                columns[term].append(value)
            seconds.append(sum(getattr(truth, term) * value for term, value in path.items()))
    fitted = RuntimeOverhead(**fit_nonnegative(columns, seconds))
    for term in ("per_action", "per_token", "per_step"):
        assert getattr(fitted, term) == pytest.approx(getattr(truth, term), rel=1e-6)


def test_units_timed_as_whole_calls_leave_the_runtimes_in_call_cost_out():
    """Calls of 0.1 ms + 10 ns per token come off the overhead's terms, never below zero."""
    overhead = RuntimeOverhead(per_action=4e-4, per_token=5e-9, per_step=2e-3)
    calls = [(n, 1e-4 + 1e-8 * n) for n in (64, 128, 256, 512, 1024) for _ in range(3)]
    left = _probes._without_calls(overhead, calls)
    assert left.per_action == pytest.approx(3e-4)
    assert left.per_token == 0.0 and left.per_step == 2e-3


def test_estimate_charges_every_action_on_the_critical_path_and_each_step_once():
    order = ScheduleSeq1F1BZBV.order_for(2, 2, 2, 4)
    shape = PipelineShape((1, 1, 1, 1), lambda k: order)
    plan = SegmentPlan.uniform(64, 4)
    runtime = RuntimeOverhead(per_action=1e-3, per_token=1e-5, per_step=0.5)
    found = estimate(plan, "uniform", shape, _free_compute(runtime))
    actions = replay(order, lambda action: 1.0).makespan
    assert found.step_seconds == pytest.approx(actions * (1e-3 + 16 * 1e-5) + 0.5)
    assert estimate(plan, "uniform", shape, _free_compute(RuntimeOverhead())).step_seconds == 0


def test_the_probe_measures_a_cost_per_action_through_the_runtime():
    found = measure_runtime_overhead(seq_len=64, dim=16)
    # Two gloo ranks on one host: each action's schedule walk, message and scope cost
    # microseconds to milliseconds, never nothing.
    assert 1e-6 < found.per_action < 0.05
    assert found.per_token >= 0 and found.per_step >= 0

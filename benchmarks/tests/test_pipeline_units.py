# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Units timed inside pipeline steps where ranks share a host: the spans read, the fit, a real probe."""

import importlib

import pytest
import torch

from benchmarks.planner_probes.compute_spans import ComputeSpan
from benchmarks.planner_probes.host_probes import CPU_HOST_PROBES
from benchmarks.planner_probes.pipeline_units import measure_pipeline_units, PipelineUnitTimes
from torchtitan_seq1f1b.planner import calibrate, CalibrationTarget, fit_unit_time, RuntimeOverhead
from torchtitan_seq1f1b.planner.time_model import fit_nonnegative, UnitTime
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

_units = importlib.import_module("benchmarks.planner_probes.pipeline_units")
_host_probes = importlib.import_module("benchmarks.planner_probes.host_probes")

SHAPE = TransformerCost(
    n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64
)


def _span(stage: int, kind: str, chunk: int, seconds: float) -> ComputeSpan:
    return ComputeSpan(stage, kind, chunk, 10.0, 10.0 + seconds)


def test_a_steps_spans_become_unit_samples():
    """k = 2 over 64 tokens on a V of 4 stages: the last stage's forwards carry their losses,
    stage 0's split backward (I empty, W the whole backward) is left out, and chunk ids map
    to their segment's (length, end)."""
    plan = SegmentPlan.uniform(64, 2)
    spans = [
        _span(0, "F", 0, 1.0),
        _span(3, "F", 1, 2.0),  # microbatch 0, segment 1
        _span(3, "I", 1, 3.0),
        _span(0, "I", 2, 0.0),
        _span(0, "W", 2, 4.0),
        _span(1, "W", 3, 5.0),  # microbatch 1, segment 1
    ]
    found = _units._unit_seconds(spans, [0.5], plan, ("F", "I", "W"), last_stage=3)
    assert found == [
        (("F", False, 2, 32, 32), 1.0),
        (("F", True, 2, 32, 64), 2.5),
        (("I", True, 2, 32, 64), 3.0),
        (("W", False, 2, 32, 64), 5.0),
    ]
    # Kinds another probe times are skipped, but the loss stays with its forward.
    assert _units._unit_seconds(spans[:2], [0.5], plan, ("I", "W"), last_stage=3) == []


def _plan_samples(seconds) -> list[tuple[int, int, float, float]]:
    """Every unit of uniform plans over 64 tokens, k = 1 to 16, as ``(length, end, seconds,
    plan seconds)`` with ``seconds(length, end)``."""
    samples = []
    for k in (1, 2, 4, 8, 16):
        plan = SegmentPlan.uniform(64, k)
        units = [(plan.lengths[s], plan.ends[s]) for s in range(k)]
        total = sum(seconds(n, e) for n, e in units)
        samples += [(n, e, seconds(n, e), total) for n, e in units]
    return samples


def _calibrate_from(monkeypatch, times: PipelineUnitTimes, chained_blocks: int):
    """``calibrate`` of a target whose ranks share the host, the probe scripted to ``times``."""
    calls = []

    def scripted(*args, **kwargs):
        calls.append((args, kwargs))
        return times

    monkeypatch.setattr(_host_probes, "measure_pipeline_units", scripted)
    monkeypatch.setattr(
        _host_probes, "measure_runtime_overhead", lambda *args, **kwargs: RuntimeOverhead()
    )
    target = CalibrationTarget(
        shape=SHAPE, seq_len=64, attention_backend="sdpa", contenders=2,
        chained_blocks=chained_blocks,
    )
    return calibrate(target, CPU_HOST_PROBES), calls


def test_the_head_is_fitted_from_what_the_last_stage_takes_beyond_its_blocks(monkeypatch):
    """Scripted probe times: 3 chained blocks of known F, B, I, W and a head of known cost on
    the last stage. The fits recover both."""
    block = UnitTime(per_token=2e-6, per_pair=3e-9, per_unit=1e-4, per_prefix_pair=1e-9)
    head = UnitTime(per_token=5e-6, per_pair=0.0, per_unit=2e-4)
    times = PipelineUnitTimes(
        block=dict.fromkeys("FBIW", _plan_samples(block)),
        last_stage=dict.fromkeys("FBIW", _plan_samples(lambda n, e: 3 * block(n, e) + head(n, e))),
    )
    model, calls = _calibrate_from(monkeypatch, times, chained_blocks=3)
    assert calls == [(
        (SHAPE, 64),
        dict(ranks=2, chained_blocks=3, microbatch_size=1, dtype=torch.float32, attention_backend="sdpa"),
    )]
    for kind in "FBIW":
        for unit_time, expected in ((model.block[kind], block), (model.head[kind], head)):
            for n, e, _, _ in times.block[kind]:
                assert unit_time(n, e) == pytest.approx(expected(n, e), rel=1e-9)


def test_residuals_are_relative_to_the_plans_time(monkeypatch):
    """Noisy times: block and head fits weigh a unit's error against its plan's time (a step's
    error is its units' errors in seconds), not against the unit's own."""
    block = UnitTime(per_token=2e-6, per_pair=0.0, per_unit=1e-4)

    def noisy(n, e):
        return 4 * block(n, e) * (1.1 if (n + e) % 3 else 0.9)

    times = PipelineUnitTimes(
        block=dict.fromkeys("FBIW", _plan_samples(lambda n, e: noisy(n, e) / 4)),
        last_stage=dict.fromkeys("FBIW", _plan_samples(lambda n, e: noisy(n, e) + 1e-6 * n)),
    )
    model, _ = _calibrate_from(monkeypatch, times, chained_blocks=4)
    samples = times.block["F"]
    plans = [plan for *_, plan in samples]
    relative_to_plan = fit_unit_time([sample[:3] for sample in samples], scale=plans)
    relative_to_unit = fit_unit_time([sample[:3] for sample in samples])
    for term in ("per_token", "per_pair", "per_unit", "per_prefix_pair"):
        fitted, expected = getattr(model.block["F"], term), getattr(relative_to_plan, term)
        assert fitted == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert relative_to_plan.per_token != pytest.approx(relative_to_unit.per_token, rel=1e-3)
    stage = times.last_stage["F"]
    left = [(n, e, t - 4 * model.block["F"](n, e)) for n, e, t, _ in stage]
    head = fit_unit_time(left, with_pairs=False, scale=[plan for *_, plan in stage])
    assert model.head["F"].per_token == pytest.approx(head.per_token, rel=1e-9)
    assert model.head["F"].per_token != pytest.approx(
        fit_unit_time(left, with_pairs=False).per_token, rel=1e-3
    )


def test_the_first_stage_computes_its_input_gradient_as_a_jobs_does():
    """A job's first stage takes the embedding's output, whose gradient its first block computes;
    the probe's first stage is handed hidden states without one and must compute it anyway."""
    stage = _units._FirstStage(SHAPE, 2, "sdpa")
    hidden = torch.randn(1, 16, SHAPE.dim)
    out = stage(hidden, torch.arange(16)[None])
    leaves, pending, seen = [], [out.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        pending.extend(next_node for next_node, _ in node.next_functions)
    assert [leaf.shape for leaf in leaves if leaf.shape == hidden.shape] == [hidden.shape]
    assert not hidden.requires_grad


def test_a_calibration_of_ranks_sharing_the_host_times_units_in_pipeline_steps():
    """End to end on two gloo ranks: both probes run and every block fit is positive."""
    target = CalibrationTarget(
        shape=SHAPE, seq_len=32, attention_backend="sdpa", contenders=2, chained_blocks=2
    )
    model = calibrate(target, CPU_HOST_PROBES)
    for kind in "FBIW":
        # This head (vocab 64) costs next to nothing beside two blocks: its fit may be 0.
        assert model.block[kind](32, 32) > 0 and model.head[kind](32, 32) >= 0
    assert model.calibrated_for == {**target.key(), "host_probes": True}
    assert model.runtime.per_step >= 0


def test_a_scale_sets_whose_relative_error_the_fit_weighs():
    constant = {"per_unit": [1.0, 1.0]}  # one constant cost, measured as 1 s and 3 s
    # Relative to the measured times, 1 s weighs nine times as much as 3 s ...
    assert fit_nonnegative(constant, [1.0, 3.0]) == {"per_unit": pytest.approx(1.2)}
    # ... relative to equal scales (a stage both were part of), the two weigh alike.
    assert fit_nonnegative(constant, [1.0, 3.0], [5.0, 5.0]) == {"per_unit": pytest.approx(2.0)}


def test_ranks_on_their_own_gpus_are_refused_a_shared_host_probe():
    with pytest.raises(ValueError, match="contenders=2 .* leave contenders at 1"):
        CalibrationTarget(shape=SHAPE, seq_len=64, device="cuda", contenders=2)
    with pytest.raises(ValueError, match="contenders must be at least 1"):
        CalibrationTarget(shape=SHAPE, seq_len=64, contenders=0)


def test_a_real_probe_times_every_kind_and_unit_shape_on_two_ranks():
    found = measure_pipeline_units(SHAPE, 32, ranks=2, chained_blocks=2, attention_backend="sdpa")
    shapes = sorted(
        (plan.lengths[s], plan.ends[s])
        for k in (1, 2, 4, 8, 16)
        for plan in [SegmentPlan.uniform(32, k)]
        for s in range(k)
    )
    for part in (found.block, found.last_stage):
        assert sorted(part) == list("BFIW")
        for kind, samples in part.items():
            assert sorted((n, e) for n, e, _, _ in samples) == shapes
            assert all(0 < seconds <= plan for _, _, seconds, plan in samples)
            # A whole-sequence unit is its plan.
            assert [seconds == plan for n, _, seconds, plan in samples if n == 32] == [True]

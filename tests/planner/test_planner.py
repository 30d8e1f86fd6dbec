# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The calibrated planner: the fit, time-balanced plans, estimates, the choice and its cache.

Timings are machine-dependent, so the choice is checked on synthetic time
models whose right answer is known; calibration itself is checked for what
it must produce (positive fits, bytes that match the store's layout, the cache).
"""

import importlib
import re
from dataclasses import replace

import pytest
import torch

from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig
from torchtitan_seq1f1b.orders import replay, seq1f1b_order
from torchtitan_seq1f1b.planner import (
    AutoPlanRequest,
    CACHE_ENV,
    cached_calibration,
    calibrate,
    CalibrationTarget,
    ContextParallelCost,
    HostProbes,
    causal_pairs,
    estimate,
    fit_unit_time,
    MAX_CHAINED_BLOCKS,
    NoPlanFitsError,
    PipelineShape,
    PredictedTime,
    prefix_rectangle,
    rank_chain_length,
    recommend,
    recommend_for,
    RuntimeOverhead,
    segment_plan,
    TimeModel,
    UnitTime,
)
from torchtitan_seq1f1b.planner.auto import _linear_fields
from torchtitan_seq1f1b.planner.llama_block import LlamaBlock
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B, ScheduleSeq1F1BZBV
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

SHAPE = TransformerCost(
    n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64
)


def _model(per_token=1e-6, per_pair=1e-9, per_unit=0.0, head_per_token=0.0) -> TimeModel:
    """A time model with B = 2F and I = W = F; 100 activation bytes per token per block."""
    forward = UnitTime(per_token, per_pair, per_unit)
    double = UnitTime(2 * per_token, 2 * per_pair, 2 * per_unit)
    head = UnitTime(head_per_token, 0.0, 0.0)
    head_double = UnitTime(2 * head_per_token, 0.0, 0.0)
    return TimeModel(
        block={"F": forward, "B": double, "I": forward, "W": forward},
        head={"F": head, "B": head_double, "I": head, "W": head},
        block_activation_bytes=100.0,
        head_activation_bytes=0.0,
        kv_bytes=10.0,
        kv_grad_bytes=10.0,
    )


def test_fit_recovers_the_coefficients_of_noiseless_times():
    truth = UnitTime(per_token=3e-6, per_pair=2e-9, per_unit=4e-4, per_prefix_pair=5e-10)
    spans = [(64, 64), (32, 64), (16, 128), (128, 128), (8, 8), (32, 96)]
    fitted = fit_unit_time([(n, end, truth(n, end)) for n, end in spans])
    for name in ("per_token", "per_pair", "per_unit", "per_prefix_pair"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_prefix_term_prices_only_segments_after_a_prefix():
    """A kernel that computes the whole masked rectangle pays it after a prefix only; the
    additive part (what time partitions balance) adds up over any split."""
    unit = UnitTime(per_token=0.0, per_pair=0.0, per_unit=0.0, per_prefix_pair=1.0)
    assert unit(64, 64) == 0 and prefix_rectangle(64, 64) == 0
    assert unit(16, 64) == prefix_rectangle(16, 64) == 16 * 64
    plain = UnitTime(per_token=3e-6, per_pair=2e-9, per_unit=4e-4, per_prefix_pair=5e-10)
    whole = plain.additive(64, 64)
    assert plain.additive(40, 40) + plain.additive(24, 64) == pytest.approx(whole, rel=1e-12)


def test_fit_drops_a_term_that_would_be_negative():
    # Times that fall with the prefix: no non-negative per_pair explains them.
    samples = [(16, end, 1e-3 - 1e-7 * end) for end in (16, 32, 64, 128)] + [(32, 32, 2e-3)]
    fitted = fit_unit_time(samples)
    assert fitted.per_pair == 0.0
    assert fitted.per_token >= 0 and fitted.per_unit >= 0


def test_time_model_round_trips_through_json():
    model = _model(per_unit=1e-4)
    assert TimeModel.from_json(model.to_json()) == model


def test_causal_pairs_add_up_over_any_split():
    plan = SegmentPlan.from_lengths([7, 20, 5, 32])
    assert sum(causal_pairs(n, e) for n, e in zip(plan.lengths, plan.ends)) == causal_pairs(64, 64)


def test_time_partition_equalises_predicted_time_not_flops():
    # Attention priced 20x its FLOP share: "time" must give late segments fewer tokens
    # than FLOP balancing does.
    per_token, per_query_key = SHAPE.token_flops(), SHAPE.pair_rates()[0]
    model = _model(per_token=per_token * 1e-12, per_pair=20 * per_query_key * 1e-12)
    timed = segment_plan("time", 4096, 4, SHAPE, model, SHAPE.n_layers)
    flops = segment_plan("balanced", 4096, 4, SHAPE, model, SHAPE.n_layers)
    cost = PredictedTime(model, SHAPE.n_layers)
    times = [cost.forward_flops(n, e) for n, e in zip(timed.lengths, timed.ends)]
    assert max(times) / min(times) < 1.01
    assert timed.lengths[-1] < flops.lengths[-1]
    flop_times = [cost.forward_flops(n, e) for n, e in zip(flops.lengths, flops.ends)]
    assert max(times) < max(flop_times)


def test_time_partition_needs_a_time_model():
    with pytest.raises(ValueError, match="calibrated time model"):
        segment_plan("time", 64, 2, SHAPE, None, SHAPE.n_layers)


def _shape(pp=2, m=2, schedule=ScheduleSeq1F1B, stages_per_rank=1) -> PipelineShape:
    return PipelineShape.even(
        SHAPE.n_layers, pp * stages_per_rank,
        lambda k: schedule.order_for(pp, stages_per_rank, m, k),
    )


def test_estimate_of_one_segment_is_1f1b_in_closed_form():
    # Equal stages, F = 2 blocks x 64 tokens x 1e-6 s, B = 2F: (m + p - 1)(F + B).
    model = _model(per_pair=0.0)
    result = estimate(SegmentPlan.uniform(64, 1), "uniform", _shape(), model)
    forward = 2 * 64 * 1e-6
    assert result.step_seconds == pytest.approx(3 * 3 * forward)
    assert result.bubble_fraction == pytest.approx(1 / 3)
    # Rank 0 holds p = 2 microbatches of 2 blocks x 64 tokens x 100 bytes, plus their K/V.
    assert result.peak_bytes[0] == 2 * (2 * 64 * 100) + 2 * (2 * 64 * 10)


def test_estimate_matches_seq1f1b_theory_for_rank_0_memory():
    # Uniform k: rank 0 holds p + k - 1 segments' activations, K/V of both microbatches in
    # flight and the gradient bank of the first.
    model = _model(per_pair=0.0)
    k = 4
    result = estimate(SegmentPlan.uniform(64, k), "uniform", _shape(), model)
    activations = (2 + k - 1) * 2 * 16 * 100
    kv = 2 * (2 * 64 * 10) + 2 * 48 * 10
    assert result.peak_bytes[0] == activations + kv


def test_estimate_replays_the_schedules_own_order():
    model = _model()
    orders = []
    shape = PipelineShape((2, 2), lambda k: orders.append(k) or seq1f1b_order(2, 2, k))
    estimate(SegmentPlan.uniform(64, 4), "uniform", shape, model)
    assert orders == [4]


def test_recommend_takes_the_fastest_plan_within_the_budget():
    # A per-unit overhead makes many segments slow, the bubble makes few slow.
    model = _model(per_pair=0.0, per_unit=2e-5)
    found = recommend(_shape(), model, SHAPE, 256)
    steps = [e.step_seconds for e in found.fitting]
    assert steps == sorted(steps) and found.best is found.fitting[0]
    assert 1 < found.best.num_segments < 16
    assert {e.num_segments for e in found.fitting} == set(range(1, 17))
    # k = 1 is the same plan under every partition: tried once.
    assert sum(e.num_segments == 1 for e in found.fitting) == 1
    budget = max(found.best.peak_bytes) - 1
    bounded = recommend(_shape(), model, SHAPE, 256, budget_bytes=budget)
    assert max(bounded.best.peak_bytes) <= budget
    assert bounded.best.step_seconds >= found.best.step_seconds
    assert found.best in bounded.over_budget


def test_recommend_never_predicts_slower_than_one_segment():
    model = _model(per_unit=1e-3)  # overhead so large that k = 1 wins
    found = recommend(_shape(), model, SHAPE, 256)
    assert found.best.num_segments == 1
    assert "k partition" in found.table()


def test_recommend_raises_naming_what_the_most_frugal_plan_needs():
    with pytest.raises(NoPlanFitsError, match=r"most frugal \(k=16.*needs"):
        recommend(_shape(), _model(), SHAPE, 256, budget_bytes=1)


def test_recommend_respects_align_and_segment_counts():
    found = recommend(
        _shape(schedule=ScheduleSeq1F1BZBV, stages_per_rank=2), _model(), SHAPE, 256,
        align=32, segment_counts=(2, 4, 16),
    )
    assert {e.num_segments for e in found.fitting} == {2, 4}  # 16 x 32 > 256
    assert all(n % 32 == 0 for e in found.fitting for n in e.plan.lengths)


def test_pipeline_shape_refuses_more_stages_than_blocks():
    with pytest.raises(ValueError, match="at least as many blocks"):
        PipelineShape.even(2, 4, lambda k: {})


RUNTIME_OVERHEAD = RuntimeOverhead(per_action=4e-4, per_token=3e-7, per_step=2e-3)


def _target(**changes) -> CalibrationTarget:
    fields = dict(shape=SHAPE, seq_len=64, attention_backend="sdpa", repeats=1)
    fields.update(changes)
    return CalibrationTarget(**fields)


def test_calibration_fits_positive_times_and_the_store_layout():
    model = calibrate(_target())
    for kind in "FBIW":
        assert model.block[kind](64, 64) > 0 and model.head[kind](64, 64) > 0
    # K and V: two tensors of n_kv_heads x head_dim float32 per token.
    assert model.kv_bytes == 2 * SHAPE.kv_dim * 4
    assert model.kv_grad_bytes == model.kv_bytes
    assert model.block_activation_bytes > 0 and model.head_activation_bytes > 0
    # A job's calibration charges nothing for the runtime's host work (it overlaps the device's).
    assert model.runtime == RuntimeOverhead()
    assert model.calibrated_for == {**_target().key(), "host_probes": False}
    assert TimeModel.from_json(model.to_json()) == model


def test_host_probes_add_the_runtime_cost_and_their_own_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    probes = HostProbes(
        unit_fits=lambda target: pytest.fail("one contender times units alone"),
        runtime_overhead=lambda target: RUNTIME_OVERHEAD,
    )
    probed, probed_path, _ = cached_calibration(_target(), probes=probes)
    plain, plain_path, _ = cached_calibration(_target())
    assert probed.runtime == RUNTIME_OVERHEAD and plain.runtime == RuntimeOverhead()
    assert probed.calibrated_for["host_probes"] and probed_path != plain_path


def test_ranks_sharing_the_host_need_host_probes():
    with pytest.raises(ValueError, match="contenders=2 needs HostProbes"):
        calibrate(_target(contenders=2))


def test_calibration_banks_bf16_gradients_in_fp32():
    model = calibrate(_target(dtype=torch.bfloat16))
    assert model.kv_bytes == 2 * SHAPE.kv_dim * 2
    assert model.kv_grad_bytes == 2 * model.kv_bytes


class _ScriptedClock:
    """Stands in for the calibration's clock: every region takes 1 s, or 10 s once ``slow_from`` regions ran."""

    regions = 0
    slow_from: int | None = None

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        cls = type(self)
        slow = cls.slow_from is not None and cls.regions >= cls.slow_from
        self.seconds = 10.0 if slow else 1.0
        cls.regions += 1


def test_a_chain_splits_its_measured_times_and_bytes_among_its_blocks(monkeypatch):
    """A chain's unit took 1 s (scripted): each of its 3 blocks is priced a third, the head 1 s;
    a block of a chain saves and stores what a block alone does."""
    calibrate_module = importlib.import_module("torchtitan_seq1f1b.planner.calibrate")
    alone = calibrate(_target())
    monkeypatch.setattr(calibrate_module, "_Clock", _ScriptedClock)
    _ScriptedClock.regions, _ScriptedClock.slow_from = 0, None
    chained = calibrate(_target(chained_blocks=3))
    for kind in "FBIW":
        for length, end in ((8, 8), (8, 64), (64, 64)):
            assert chained.block[kind](length, end) == pytest.approx(1 / 3)
            assert chained.head[kind](length, end) == pytest.approx(1.0)
    assert chained.block_activation_bytes == alone.block_activation_bytes
    assert chained.kv_bytes == alone.kv_bytes == 2 * SHAPE.kv_dim * 4


def test_a_job_chains_the_blocks_a_rank_holds_up_to_the_cap():
    assert rank_chain_length(8, 2) == 4  # the bench model at pp = 2, whatever its stages per rank
    assert rank_chain_length(7, 2) == 3
    assert rank_chain_length(80, 8) == MAX_CHAINED_BLOCKS
    assert rank_chain_length(2, 4) == 1
    with pytest.raises(ValueError, match="chained_blocks must be at least 1"):
        _target(chained_blocks=0)


def test_each_unit_keeps_its_fastest_pass_when_most_passes_ran_slow(monkeypatch):
    """A slow stretch of the host covering two of three passes must not reach the fit."""
    calibrate_module = importlib.import_module("torchtitan_seq1f1b.planner.calibrate")
    monkeypatch.setattr(calibrate_module, "_Clock", _ScriptedClock)
    block = LlamaBlock(SHAPE, attention_backend="sdpa")
    positions = torch.arange(64)[None]

    def regions(repeats: int) -> int:
        _ScriptedClock.regions = 0
        calibrate_module._measure(block, _target(repeats=repeats), positions, 64)
        return _ScriptedClock.regions

    per_pass = regions(2) - regions(1)
    warm_up = regions(1) - per_pass
    _ScriptedClock.regions, _ScriptedClock.slow_from = 0, warm_up + per_pass
    samples = calibrate_module._measure(block, _target(repeats=3), positions, 64)
    assert {seconds for kind in "FBIW" for _, _, seconds in samples[kind]} == {1.0}
    assert _ScriptedClock.regions == warm_up + 3 * per_pass


def test_cache_is_read_back_for_the_same_target_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQ1F1B_CALIBRATION_CACHE", str(tmp_path))
    first, path, cached = cached_calibration(_target())
    assert not cached and path.parent == tmp_path
    again, same_path, cached = cached_calibration(_target())
    assert cached and same_path == path and again == first
    _, other_path, cached = cached_calibration(_target(microbatch_size=2))
    assert not cached and other_path != path
    _, chained_path, cached = cached_calibration(_target(chained_blocks=2))
    assert not cached and chained_path not in (path, other_path)
    _, _, cached = cached_calibration(_target(), refresh=True)
    assert not cached


def test_the_first_stage_runs_its_whole_backward_in_w():
    """Token ids take no gradient: torch's I is empty on the first stage, its W is B."""
    model = _model(per_unit=1e-4)
    for kind, first in (("I", 0.0), ("W", model.unit_seconds("B", 16, 32, 3, False))):
        assert model.unit_seconds(kind, 16, 32, 3, False, is_first=True) == first
        assert model.unit_seconds(kind, 16, 32, 3, False) == 3 * model.block[kind](16, 32)
    # A ZB-V estimate replays stage 0's I and W that way (and the step differs from pricing
    # them as on any other stage).
    order = ScheduleSeq1F1BZBV.order_for(2, 2, 2, 2)
    shape = PipelineShape((1, 1, 1, 1), lambda k: order)
    plan = SegmentPlan.uniform(64, 2)

    def replayed(first_stage_rule: bool) -> float:
        def seconds(a):
            n, end = plan.lengths[a.segment], plan.ends[a.segment]
            return model.unit_seconds(a.kind, n, end, 1, a.stage == 3, first_stage_rule and a.stage == 0)
        return replay(order, seconds).makespan

    assert estimate(plan, "uniform", shape, model).step_seconds == replayed(True) != replayed(False)


def test_gated_delta_net_blocks_carry_a_state_instead_of_a_kv_store():
    # Rank 0 of 2, 2 blocks, half of them GatedDeltaNet, k = 4 uniform at 64 tokens.
    # The softmax block's store: 64 x 10 per microbatch, its bank 48 x 10. At the peak the
    # first microbatch has banked its gradients and both have run three of their
    # segments, each leaving a 1000-byte carry per GatedDeltaNet block for the next;
    # the bank holds 3000 more. Activations as without: 5 units of 3200.
    shape = replace(_shape(), linear_share=0.5, carry_bytes=1000, carry_grad_bytes=3000)
    result = estimate(SegmentPlan.uniform(64, 4), "uniform", shape, _model(per_pair=0.0))
    assert result.peak_bytes[0] == 16000 + 2 * 640 + 480 + 6 * 1000 + 3000
    # The carry does not grow with the sequence; the K/V store does.
    longer = estimate(SegmentPlan.uniform(128, 4), "uniform", shape, _model(per_pair=0.0))
    assert longer.peak_bytes[0] - result.peak_bytes[0] == 16000 + 2 * 640 + 480


def test_a_request_with_gated_delta_net_layers_shapes_the_carry():
    request = AutoPlanRequest(
        shape=replace(SHAPE, linear_layers=3), seq_len=64, num_ranks=2, stages_per_rank=1,
        microbatches=2, order_for=ScheduleSeq1F1B.order_for, microbatch_size=2,
        dtype=torch.bfloat16,
    )
    layer = GatedDeltaNetConfig.like_attention(SHAPE)
    state = 4 * SHAPE.n_heads * SHAPE.head_dim * SHAPE.value_head_dim
    tail = 3 * (2 * SHAPE.n_kv_heads * SHAPE.head_dim + SHAPE.n_heads * SHAPE.value_head_dim)
    assert layer.carry_bytes(2) == state + 2 * tail
    fields = _linear_fields(request)
    assert fields == {
        "linear_share": 3 / SHAPE.n_layers,
        "carry_bytes": 2 * (state + 2 * tail),
        "carry_grad_bytes": 2 * (state + 4 * tail),
    }


# ---- context parallelism --------------------------------------------------------------


@pytest.mark.parametrize("cp,peak", [(1, 16000 + 3520), (2, 8000 + 3520), (4, 4000 + 3520)])
def test_context_parallel_divides_activations_not_the_kv_store(cp, peak):
    # Rank 0 of 2, 2 blocks, k = 4 uniform at 64 tokens: p + k - 1 = 5 segments of
    # 16 / cp tokens x 2 blocks x 100 bytes = 16000 / cp; the gathered store of both
    # microbatches, 2 x 2 blocks x 64 x 10 = 2560, and the first's bank, 2 x 48 x 10 = 960.
    result = estimate(
        SegmentPlan.uniform(64, 4, align=2 * cp), "uniform", _shape(), _model(per_pair=0.0),
        ContextParallelCost(cp),
    )
    assert result.peak_bytes[0] == peak


def test_context_parallel_time_is_a_share_of_compute_plus_the_collectives():
    # k = 1, 2 blocks per stage, c = 2 at 1e6 bytes/s and 1e-4 s a collective: each layer
    # moves (c - 1) / c x 64 tokens x 10 bytes = 320 bytes each way, 4.2e-4 s.
    # F = 2 x (64e-6 / 2 + 4.2e-4), B = 2 x (128e-6 / 2 + 4.2e-4); 1F1B: (m + p - 1)(F + B).
    cp = ContextParallelCost(2, bytes_per_second=1e6, latency=1e-4)
    result = estimate(SegmentPlan.uniform(64, 1), "uniform", _shape(), _model(per_pair=0.0), cp)
    assert result.step_seconds == pytest.approx(3 * (9.04e-4 + 9.68e-4), rel=1e-12)
    # The call's fixed cost is not shared; W moves nothing, except on the first stage,
    # whose W is the whole backward.
    assert UnitTime(1e-6, 0.0, 1e-3)(64, 64, share=4) == pytest.approx(16e-6 + 1e-3)
    model = _model(per_pair=0.0)
    assert model.unit_seconds("W", 64, 64, 2, False, context_parallel=cp) == pytest.approx(64e-6)
    assert model.unit_seconds("W", 64, 64, 2, False, True, cp) == pytest.approx(9.68e-4)
    assert model.unit_seconds("I", 64, 64, 2, False, context_parallel=cp) == pytest.approx(9.04e-4)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_plans_are_multiples_of_2c_and_of_align(cp):
    found = recommend(
        _shape(), _model(), SHAPE, 96, align=3, partitions=("uniform", "balanced"),
        segment_counts=(2, 4, 8), context_parallel=ContextParallelCost(cp),
    )
    multiple = {1: 3, 2: 12, 4: 24}[cp]  # lcm(3, 2c)
    assert all(n % multiple == 0 for e in found.fitting for n in e.plan.lengths)
    assert {e.num_segments for e in found.fitting} == {k for k in (2, 4, 8) if k * multiple <= 96}


def _request(**changes) -> AutoPlanRequest:
    job = dict(shape=SHAPE, seq_len=96, num_ranks=2, stages_per_rank=1, microbatches=2,
               order_for=ScheduleSeq1F1B.order_for, partitions=("uniform",))
    return AutoPlanRequest(**{**job, **changes})


def test_a_request_takes_its_context_parallel_degree_to_the_plan():
    assert _request().context_parallel == 1
    found = recommend_for(_request(context_parallel=4, segment_counts=(1, 2, 4)), _model())
    assert {e.num_segments for e in found.fitting} == {1, 2, 4}
    assert all(n % 8 == 0 for e in found.fitting for n in e.plan.lengths)


@pytest.mark.parametrize("changes,message", [
    (dict(context_parallel=0), "context_parallel=0 must be a positive int"),
    (dict(context_parallel=4, seq_len=100),
     "context_parallel=4: context parallelism of degree 4 cuts every segment into 8 pieces, "
     "so segment lengths are multiples of 8 and seq_len 100 is not one; pick a seq_len "
     "divisible by 8 (e.g. 96 or 104)"),
    (dict(context_parallel=2, align=3, seq_len=102), "multiples of 12 (lcm with align 3)"),
    (dict(context_parallel=2, cp_bytes_per_second=0.0), "bytes_per_second=0.0 must be > 0"),
])
def test_a_request_refuses_a_context_parallel_degree_its_sequences_cannot_take(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _request(**changes)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The pipeline simulator: bubbles, activation peaks, the paper's memory figure, the CLI."""

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from torchtitan_seq1f1b import (
    SegmentAction,
    interleaved_seq1f1b_order,
    seq1f1b_order,
    seq1f1b_zero_bubble_order,
    TransformerCost,
    validate_order,
)
from torchtitan_seq1f1b._torch_compat.introspection import torch_schedule_order
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig
from torchtitan_seq1f1b.orders import gpipe_order, replay, v_stage_to_rank
from torchtitan_seq1f1b.planner import estimate, PipelineShape, RuntimeOverhead, TimeModel, UnitTime
from torchtitan_seq1f1b.tools.model_shapes import get_preset, layer_params
from torchtitan_seq1f1b.tools.simulate import (
    analytic_bubble,
    main,
    MemoryModel,
    PAPER_CONFIGS,
    run_paper,
    schedule_order,
    SCHEDULE_SPECS,
    SCHEDULES,
    SimConfig,
    simulate,
)
from torchtitan_seq1f1b.tools.simulate.unit_times import _weight_grad_flops

TOLERANCE = 0.08
SMALL = get_preset("paper-7b")


def _config(schedule, p, m, k=4, partition="uniform", **kwargs):
    return SimConfig(
        model=SMALL, seq_len=4096, pp=p, microbatches=m, segments=k,
        schedule=schedule, partition=partition, **kwargs,
    )


def _equal_units(k, v=1):
    """F = I = W = 1/(k v), B = 2/(k v)."""
    return lambda a: (2 if a.kind == "B" else 1) / (k * v)


def _stage_to_rank(schedule, p):
    if schedule in ("ZBVZeroBubble", "Seq1F1BZBV"):
        return v_stage_to_rank(p)
    return lambda s: s % p


# ---- timeline ---------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,k", [(1, 3, 2), (2, 2, 1), (4, 8, 4), (4, 2, 4), (8, 16, 4), (3, 5, 3)]
)
def test_equal_cost_units_reproduce_the_analytic_bubble(p, m, k):
    order = seq1f1b_order(p, m, k)
    timeline = replay(order, lambda a: (1 if a.kind == "F" else 2) / k)
    assert timeline.bubble_fraction == pytest.approx(analytic_bubble(p, m, k), abs=1e-12)
    assert timeline.makespan == pytest.approx((m * k + p - 1) * 3 / k, abs=1e-12)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "Seq1F1BZBV"])
def test_reported_equal_cost_bubble_is_the_analytic_one(schedule):
    result = simulate(_config(schedule, p=4, m=8, k=4, partition="balanced"))
    k = 4 if SCHEDULE_SPECS[schedule].segmented else 1
    v = 2 if SCHEDULE_SPECS[schedule].multi_stage else 1
    work = 3 if schedule.endswith("ZeroBubble") else 1  # F + I + W units fill ZB's bubble
    assert (result.config.num_segments, result.config.v) == (k, v)
    assert result.analytic_bubble_fraction == pytest.approx(3 / (work * v * 8 * k + 3))
    assert result.equal_cost_bubble_fraction == pytest.approx(result.analytic_bubble_fraction)


@pytest.mark.parametrize("p,m,k", itertools.product((2, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4)))
def test_seq1f1b_zbv_idles_no_more_than_zero_bubble(p, m, k):
    """The V order never idles more than the one-stage ZB-H1 order, and reaches
    ZB-V's ideal (p-1)/(6*m*k + p-1) once the m*k units fill its warmup."""
    zbv = simulate(_config("Seq1F1BZBV", p=p, m=m, k=k, partition="uniform"))
    zb = simulate(_config("Seq1F1BZeroBubble", p=p, m=m, k=k, partition="uniform"))
    assert zbv.equal_cost_bubble_fraction <= zb.equal_cost_bubble_fraction + 1e-12
    if m * k >= 2 * p + k - 2:
        ideal = (p - 1) / (6 * m * k + p - 1)
        assert zbv.equal_cost_bubble_fraction == pytest.approx(ideal, abs=1e-12)


@pytest.mark.parametrize(
    "p,v,m,k",
    [c for c in itertools.product(range(1, 6), range(2, 5), range(1, 6), range(1, 5))
     if c[2] * c[3] >= c[0]],
)
def test_interleaved_seq1f1b_bubble_is_analytic(p, v, m, k):
    timeline = replay(interleaved_seq1f1b_order(p, v, m, k), _equal_units(k, v))
    assert timeline.bubble_fraction == pytest.approx(analytic_bubble(p, m, k, v), abs=1e-12)


@pytest.mark.parametrize("p,m,k", list(itertools.product(range(1, 7), range(1, 7), range(1, 5))))
def test_zero_bubble_beats_seq1f1b_with_equal_costs(p, m, k):
    seq = replay(seq1f1b_order(p, m, k), _equal_units(k)).bubble_fraction
    zb = replay(seq1f1b_zero_bubble_order(p, m, k), _equal_units(k)).bubble_fraction
    if p == 1:
        assert zb == seq == 0
        return
    assert zb < seq
    if m * k >= p + k - 1:  # every rank reaches steady state: ZB-H1's (p-1) idle forwards
        assert zb == pytest.approx((p - 1) / (3 * m * k + p - 1), abs=1e-12)


def test_zero_bubble_paper_example():
    seq = replay(seq1f1b_order(4, 2, 4), _equal_units(4)).bubble_fraction
    zb = replay(seq1f1b_zero_bubble_order(4, 2, 4), _equal_units(4)).bubble_fraction
    assert (round(seq, 3), round(zb, 3)) == (0.273, 0.111)


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 6) for m in range(1, 10)])
def test_torch_multi_stage_bubbles(p, m):
    bfs = replay(schedule_order(_config("LoopedBFS", p, m)), _equal_units(1, 2))
    zbv = replay(schedule_order(_config("ZBVZeroBubble", p, m)), _equal_units(1, 2))
    if m >= p:
        assert bfs.bubble_fraction == pytest.approx(analytic_bubble(p, m, 1, 2), abs=1e-12)
    if m >= 2 * p - 1:
        assert zbv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m,k", [(1, 2, 2), (2, 3, 2), (3, 2, 3), (4, 5, 2)])
def test_every_simulated_order_is_valid(schedule, p, m, k):
    config = SimConfig(model=SMALL, seq_len=1024, pp=p, microbatches=m, segments=k,
                       schedule=schedule)
    validate_order(schedule_order(config), config.num_stages, m, config.num_segments,
                   _stage_to_rank(schedule, p))


@pytest.mark.parametrize(
    "p,v,m", [(2, 2, 2), (2, 3, 4), (4, 2, 4), (4, 2, 8), (3, 3, 6), (4, 2, 5)]
)
def test_interleaved_1f1b_is_torchs_order(p, v, m):
    """k = 1 runs torch's Interleaved1F1B order (m here is always one torch accepts)."""
    rounds = max(1, m // p)
    assert m % rounds == 0
    ours = schedule_order(SimConfig(model=SMALL, seq_len=1024, pp=p, microbatches=m,
                                    schedule="Interleaved1F1B", v=v))
    torch_order = torch_schedule_order("Interleaved1F1B", p, v, m)
    assert ours == {
        rank: [SegmentAction.from_action(a, 1) for a in actions]
        for rank, actions in torch_order.items()
    }


def test_p2p_latency_only_between_ranks():
    # Stages 0 and 1 on one rank (as ZB-V's middle stages): no latency between them.
    order = {0: [SegmentAction.from_str(a) for a in "0F0.0 1F0.0 1B0.0 0B0.0".split()]}
    assert replay(order, _equal_units(1), p2p_latency=5.0).makespan == 6.0


def test_one_f_one_b_bubble_needs_no_equal_cost_assumption():
    # A whole microbatch is the unit: every unit costs the same by construction.
    result = simulate(_config("1F1B", p=4, m=16))
    assert result.makespan == pytest.approx(57.0)  # (m + p - 1) * (F + B)
    assert result.bubble_fraction == pytest.approx(3 / 19)


def test_balanced_partition_beats_even_split_on_causal_costs():
    # Design note anchor: 7B, 32k, p=4, m=16: even split is worse than 1F1B, balanced better.
    base = dict(model=SMALL, seq_len=32768, pp=4, microbatches=16, segments=4, schedule="Seq1F1B")
    even = simulate(SimConfig(partition="uniform", **base)).makespan
    balanced = simulate(SimConfig(partition="balanced", **base)).makespan
    assert balanced == pytest.approx(50.25, abs=0.02)
    assert 63.5 < even < 64.5
    assert balanced < 57.0 < even


def test_p2p_latency_lengthens_the_step():
    without = simulate(_config("Seq1F1B", p=4, m=4)).makespan
    with_latency = simulate(_config("Seq1F1B", p=4, m=4, p2p_latency=0.1)).makespan
    assert with_latency > without


def test_gpipe_order_is_valid():
    for p, m, k in [(1, 1, 1), (2, 3, 1), (3, 2, 2), (4, 4, 1)]:
        validate_order(gpipe_order(p, m, k), p, m, k)


# ---- memory -----------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,k", [(1, 2, 2), (2, 4, 2), (4, 8, 4), (4, 4, 2), (8, 8, 4), (4, 6, 8)]
)
def test_rank0_activation_peak_in_microbatches(p, m, k):
    seq = simulate(_config("Seq1F1B", p, m, k))
    one_f_one_b = simulate(_config("1F1B", p, m))
    assert seq.ranks[0].peak_activation_microbatches == pytest.approx(min(m * k, p + k - 1) / k)
    assert one_f_one_b.ranks[0].peak_activation_microbatches == pytest.approx(min(m, p))


@pytest.mark.parametrize(
    "p,v,m,k",
    [c for c in itertools.product(range(2, 7), range(2, 5), range(1, 9), range(1, 5))
     if c[0] % c[3] == 0 and c[2] * c[3] % c[0] == 0
     and c[1] * c[2] * c[3] >= (c[1] + 1) * c[0] + c[3] - 2],
)
def test_interleaved_seq1f1b_rank0_peak_is_the_theory_table(p, v, m, k):
    # Equal segments, equal stages; rounds of p units hold whole microbatches (k | p).
    model = TransformerCost(p * v, 64, 4, 4, 256, 1000, gated_mlp=True)
    result = simulate(SimConfig(model=model, seq_len=60 * k, pp=p, microbatches=m, segments=k,
                                schedule="InterleavedSeq1F1B", v=v, partition="uniform"))
    expected = ((v + 1) * p + k - 2) / (v * k)
    assert result.ranks[0].peak_activation_microbatches == pytest.approx(expected)


@pytest.mark.parametrize("p,m,k", [(2, 2, 2), (4, 2, 4), (4, 4, 4), (4, 8, 2), (8, 4, 4)])
def test_zero_bubble_peak_stays_within_seq1f1b_rank0(p, m, k):
    seq = simulate(_config("Seq1F1B", p, m, k))
    zb = simulate(_config("Seq1F1BZeroBubble", p, m, k))
    rank0_units = seq.ranks[0].peak_activation_microbatches * k
    assert rank0_units == pytest.approx(min(m * k, p + k - 1))
    for rank in zb.ranks:
        assert rank.peak_activation_microbatches * k <= rank0_units + 1e-9


def test_split_backward_activations_live_until_weight_grad():
    # The units a rank holds are those forwarded and not yet through W (I frees nothing).
    p, m, k = 4, 4, 4
    result = simulate(_config("Seq1F1BZeroBubble", p, m, k))
    for rank, actions in schedule_order(result.config).items():
        held, peak = 0, 0
        for action in actions:
            held += {"F": 1, "I": 0, "W": -1}[action.kind]
            peak = max(peak, held)
        assert result.ranks[rank].peak_activation_microbatches * k == pytest.approx(peak)
    # The last rank defers W by p - 1 actions: it holds more than under Seq1F1B.
    assert result.ranks[-1].peak_activation_microbatches > (
        simulate(_config("Seq1F1B", p, m, k)).ranks[-1].peak_activation_microbatches
    )


def test_kv_store_freed_after_last_weight_grad():
    zb = simulate(_config("Seq1F1BZeroBubble", 4, 4, 4)).ranks[-1]
    seq = simulate(_config("Seq1F1B", 4, 4, 4)).ranks[-1]
    assert zb.peak_kv_bytes > seq.peak_kv_bytes  # microbatches stay until their W


def test_weight_grad_flops_are_the_matmuls():
    cost = SMALL
    h, d, f = SMALL.dim, SMALL.head_dim, SMALL.ffn_hidden_dim
    per_token = SMALL.n_layers * (4 * h * h + 4 * h * SMALL.n_kv_heads * d + 2 * 2 * h * f)
    per_token += 2 * h * SMALL.vocab_size
    for length, end in [(1, 1), (1000, 4096), (4096, 4096)]:
        assert _weight_grad_flops(cost, length, end) == pytest.approx(length * per_token, rel=1e-12)


def test_flops_backward_split_moves_work_not_its_total():
    equal = simulate(_config("Seq1F1BZeroBubble", 4, 4, 4, backward_split="equal"))
    flops = simulate(_config("Seq1F1BZeroBubble", 4, 4, 4, backward_split="flops"))
    assert [r.busy for r in flops.ranks] == pytest.approx([r.busy for r in equal.ranks])
    assert flops.makespan != pytest.approx(equal.makespan)


def test_multi_stage_memory_sums_the_ranks_stages():
    result = simulate(_config("ZBVZeroBubble", 4, 8))
    assert [r.stages for r in result.ranks] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # Rank 0 holds 1F1B rank 0's blocks and embedding, plus the LM head of stage 7.
    states = [r.model_state_bytes for r in simulate(_config("1F1B", 4, 8)).ranks]
    assert result.ranks[0].model_state_bytes == states[0] + states[3] - states[1]


def test_gpipe_holds_every_microbatch():
    result = simulate(_config("GPipe", p=4, m=6))
    assert result.ranks[0].peak_activation_microbatches == pytest.approx(6)


def test_balanced_split_raises_the_peak_a_little():
    # Design note: ~1.93 microbatches at 32k (p=4, k=4) instead of 1.75 for an even split.
    cfg = dict(model=SMALL, seq_len=32768, pp=4, microbatches=8, schedule="Seq1F1B")
    balanced = simulate(SimConfig(partition="balanced", **cfg)).ranks[0]
    assert 1.85 < balanced.peak_activation_microbatches < 2.0


def test_activation_formula_is_korthikanti_34_for_gpt_shapes():
    # Last stage excluded (it also holds the loss softmax); b=1, tp=1.
    cfg = SimConfig(model=SMALL, seq_len=2048, pp=2, microbatches=1, schedule="1F1B")
    rank0 = simulate(cfg).ranks[0]
    s, h, layers = 2048, SMALL.dim, SMALL.n_layers // 2
    assert rank0.peak_activation_bytes == s * h * 34 * layers
    eager = simulate(SimConfig(model=SMALL, seq_len=2048, pp=2, microbatches=1, schedule="1F1B",
                               memory=MemoryModel(attention="eager"))).ranks[0]
    a = SMALL.n_heads
    assert eager.peak_activation_bytes == s * h * (34 + 5 * a * s / h) * layers
    # Sequence parallel divides everything by tp; without it, only 24 of the 34.
    tp = 8
    sp = simulate(SimConfig(model=SMALL, seq_len=2048, pp=2, tp=tp, microbatches=1,
                            schedule="1F1B")).ranks[0]
    no_sp = simulate(SimConfig(
        model=SMALL, seq_len=2048, pp=2, tp=tp, microbatches=1, schedule="1F1B",
        memory=MemoryModel(sequence_parallel=False),
    )).ranks[0]
    assert sp.peak_activation_bytes == s * h * 34 / tp * layers
    assert no_sp.peak_activation_bytes == s * h * (10 + 24 / tp) * layers


def test_model_states_are_18_bytes_per_param_and_dp_shards_the_optimizer():
    cfg = dict(model=SMALL, seq_len=1024, pp=4, microbatches=4, schedule="1F1B", tp=2)
    plain = simulate(SimConfig(dp=4, **cfg)).ranks[1]
    sharded_memory = MemoryModel(distributed_optimizer=True)
    sharded = simulate(SimConfig(dp=4, memory=sharded_memory, **cfg)).ranks[1]
    params = 8 * layer_params(SMALL, 2)
    assert plain.model_state_bytes == 18 * params
    assert sharded.model_state_bytes == 6 * params + 12 * params // 4


def test_kv_store_only_for_segments():
    assert simulate(_config("1F1B", p=4, m=4)).ranks[0].peak_kv_bytes == 0
    assert simulate(_config("Seq1F1B", p=4, m=4)).ranks[0].peak_kv_bytes > 0


# ---- linear attention -----------------------------------------------------------

# qwen3_5 4B's shape: 32 layers, 16 query / 4 K/V heads of 256; GatedDeltaNet 16 key and
# 32 value heads of 128, conv width 4.
QWEN35_4B = TransformerCost(n_layers=32, dim=2560, n_heads=16, n_kv_heads=4, qk_head_dim=256,
                            ffn_hidden_dim=9216, vocab_size=248320)
QWEN35_4B_GDN = GatedDeltaNetConfig(dim=2560, n_key_heads=16, n_value_heads=32,
                                    key_head_dim=128, value_head_dim=128)


def _store_bytes(linear_layers, seq_len, p=4, m=8, k=4):
    config = SimConfig(
        model=replace(QWEN35_4B, linear_layers=linear_layers), seq_len=seq_len, pp=p,
        microbatches=m, segments=k, partition="uniform", linear_attention=QWEN35_4B_GDN,
    )
    return simulate(config).ranks[0].peak_kv_bytes


def test_linear_attention_store_does_not_grow_with_the_sequence():
    assert _store_bytes(32, 32768) == _store_bytes(32, 131072) > 0
    assert _store_bytes(0, 131072) == 4 * _store_bytes(0, 32768)


def test_linear_attention_store_of_one_microbatch_is_the_carry_formula():
    # pp = 1, m = 1, k = 4: the peak is at the first backward. A softmax layer holds bf16
    # K/V of the 32k sequence and fp32 gradients of its first 24k positions; a GDN layer
    # 3 bf16-tail carries and one fp32 gradient of one: the fp32 32 x 128 x 128 state and
    # the 3 x (2 x 16 x 128 + 32 x 128) tail.
    state, tail = 4 * 32 * 128 * 128, 3 * (2 * 16 * 128 + 32 * 128)
    softmax = 2 * 4 * 256 * (32768 * 2 + 24576 * 4)
    linear = 3 * (state + 2 * tail) + state + 4 * tail
    assert _store_bytes(0, 32768, p=1, m=1) == 32 * softmax
    assert _store_bytes(24, 32768, p=1, m=1) == 8 * softmax + 24 * linear


def test_qwen3_5_store_is_a_quarter_of_softmax_plus_the_states():
    # Layers of both kinds spread evenly over the stages: every stage holds 2 + 6.
    for seq_len in (32768, 131072):
        quarter = _store_bytes(0, seq_len) / 4
        assert _store_bytes(24, seq_len) == quarter + _store_bytes(32, seq_len) * 3 / 4


def test_linear_attention_shape_defaults_to_the_attention_heads():
    config = SimConfig(model=replace(SMALL, linear_layers=8), seq_len=4096, pp=2,
                       microbatches=2)
    assert config.linear_attention == GatedDeltaNetConfig(
        dim=4096, n_key_heads=32, n_value_heads=32, key_head_dim=128, value_head_dim=128
    )


def test_cli_linear_attention_options(tmp_path):
    peaks = []
    for linear in ([], ["--linear-layers", "24", "--linear-value-heads", "64"]):
        path = tmp_path / "out.json"
        argv = ["--model", "paper-7b", "--seq-len", "8192", "--pp", "4", "-m", "8",
                "--schedule", "Seq1F1B", "--json", str(path), *linear]
        assert main(argv) == 0
        peaks.append(json.loads(path.read_text())[0]["peak_memory_bytes"][0])
    assert peaks[1] < peaks[0]


# ---- context parallelism --------------------------------------------------------

# One block per stage; a token leaves (4 + 2 + 2) * 8 + (2 + 4 / 2 + 2) * 8 + 8 * 16 = 240
# bytes in it (no TP, no dropout) and 2 x 4 x 2 = 16 bytes of bf16 K/V (32 of fp32 gradient).
CP_MODEL = TransformerCost(n_layers=2, dim=8, n_heads=2, n_kv_heads=1, ffn_hidden_dim=16,
                           vocab_size=32)


def _cp_config(schedule, cp, **kwargs):
    return SimConfig(
        model=CP_MODEL, seq_len=64, pp=2, microbatches=2, segments=4, schedule=schedule,
        partition="uniform", cp=cp, memory=MemoryModel(sequence_parallel=False, dropout=False),
        **kwargs,
    )


@pytest.mark.parametrize("schedule,cp,activations,kv", [
    # 1F1B: p = 2 microbatches of 64 tokens, 64 x 240 / cp each; under CP their gathered
    # K/V, 2 x 64 x 16, as torchtitan's CP attention saves it for backward.
    ("1F1B", 1, 30720, 0), ("1F1B", 2, 15360, 2048), ("1F1B", 4, 7680, 2048),
    # Seq1F1B, k = 4: p + k - 1 = 5 segments of 16 tokens, 16 x 240 / cp each; the stores
    # of both microbatches, 2 x 64 x 16, and the first's fp32 bank, 48 x 32: not divided.
    ("Seq1F1B", 1, 19200, 3584), ("Seq1F1B", 2, 9600, 3584), ("Seq1F1B", 4, 4800, 3584),
])
def test_context_parallel_divides_activations_not_the_gathered_kv(schedule, cp, activations, kv):
    rank0 = simulate(_cp_config(schedule, cp)).ranks[0]
    assert (rank0.peak_activation_bytes, rank0.peak_kv_bytes) == (activations, kv)
    assert rank0.peak_memory_bytes - rank0.model_state_bytes == activations + kv


def test_context_parallel_collectives_lengthen_every_forward_and_backward():
    # device_flops makes a forward of a microbatch over a rank's block 1 s; each K/V
    # collective moves (2 - 1) / 2 x 64 x 16 = 512 bytes: 0.5 + 512 / 512 = 1.5 s.
    # F = 1 / 2 + 1.5, B = 2 / 2 + 1.5; 1F1B's step: (m + p - 1)(F + B).
    flops = CP_MODEL.forward_flops(64, 64) / 2
    result = simulate(_cp_config("1F1B", 2, cp_bytes_per_second=512.0, cp_latency=0.5,
                                 device_flops=flops))
    assert result.makespan == pytest.approx(3 * (2.0 + 2.5), rel=1e-12)
    assert result.to_record()["config"]["cp"] == 2


@pytest.mark.parametrize("cp,tp,align,multiple", [(4, 2, None, 8), (2, 1, 3, 12), (1, 1, 3, 3)])
def test_context_parallel_segments_are_multiples_of_2c_and_of_align(cp, tp, align, multiple):
    config = SimConfig(model=SMALL, seq_len=4608, pp=2, microbatches=2, segments=8, tp=tp,
                       cp=cp, align=align)
    assert config.segment_align == multiple
    assert all(n % multiple == 0 for n in config.plan().lengths)


def test_context_parallel_shards_the_distributed_optimizer_over_dp_x_cp():
    cfg = dict(model=SMALL, seq_len=1024, pp=4, microbatches=4, schedule="1F1B", dp=2, cp=2,
               memory=MemoryModel(distributed_optimizer=True))
    params = 8 * layer_params(SMALL, 1)
    assert simulate(SimConfig(**cfg)).ranks[1].model_state_bytes == 6 * params + 12 * params // 4


# ---- the paper ----------------------------------------------------------------


def test_paper_ratios_within_tolerance():
    records = run_paper()
    assert {r["config"] for r in records} == {c.label for c in PAPER_CONFIGS}
    for rec in records:
        assert rec["predicted_gb"] > 0
        if rec["schedule"] in ("1F1B", "Seq1F1B"):  # the fitted layouts; interleaved: reported
            assert abs(rec["predicted_ratio"] - rec["published_ratio"]) <= TOLERANCE, rec


# ---- command line ---------------------------------------------------------------


def test_cli_json_records(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["--model", "llama3-8b", "--seq-len", "8192", "--pp", "4", "--tp", "2",
                 "-m", "8", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["schedule"] for r in records] == ["1F1B", "GPipe", "Seq1F1B"]
    for rec in records:
        assert {"schedule", "makespan", "bubble_fraction", "peak_memory_bytes",
                "analytic_bubble_fraction", "equal_cost_bubble_fraction"} <= rec.keys()
        assert len(rec["peak_memory_bytes"]) == 4
        assert all(isinstance(b, int) and b > 0 for b in rec["peak_memory_bytes"])
    assert "Seq1F1B" in capsys.readouterr().out


def test_cli_paper_json(tmp_path, capsys):
    path = tmp_path / "paper.json"
    assert main(["--paper", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert len(records) == 4 * len(PAPER_CONFIGS)
    for rec in records:
        assert {"config", "schedule", "predicted_gb", "published_gb"} <= rec.keys()
    assert "7B 32xGPU 32k" in capsys.readouterr().out


def test_cli_takes_the_context_parallel_degree_for_every_schedule(tmp_path, capsys):
    path = tmp_path / "cp.json"
    assert main(["--layers", "2", "--dim", "8", "--heads", "2", "--kv-heads", "1", "--ffn-dim",
                 "16", "--vocab", "32", "--seq-len", "64", "--pp", "2", "-m", "2", "--cp", "4",
                 "--no-sequence-parallel", "--no-dropout", "--partition", "uniform",
                 "--json", str(path)]) == 0
    assert "pp=2 tp=1 dp=1 cp=4 m=2" in capsys.readouterr().out
    records = {r["schedule"]: r for r in json.loads(path.read_text())}
    assert {r["config"]["cp"] for r in records.values()} == {4}
    # Rank 0's activations and K/V as test_context_parallel_divides_activations_not_the_
    # gathered_kv's at c = 4.
    assert [records[s]["ranks"][0]["peak_activation_bytes"] for s in ("1F1B", "Seq1F1B")] == [
        7680, 4800]


def test_cli_explicit_dims_and_schedule_names(capsys):
    assert main(["--layers", "8", "--dim", "512", "--heads", "8", "--kv-heads", "2",
                 "--seq-len", "1024", "--pp", "2", "-m", "4", "--schedule", "seq1f1b", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "Seq1F1B" in out and "1F1B" in out and "GPipe" not in out


def test_cli_multi_stage_and_zero_bubble_schedules(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["--model", "paper-7b", "--seq-len", "4096", "--pp", "4", "-m", "4",
                 "--schedule", "InterleavedSeq1F1B", "Seq1F1BZeroBubble", "Interleaved1F1B",
                 "-v", "4", "--json", str(path)]) == 0
    records = {r["schedule"]: r for r in json.loads(path.read_text())}
    assert {name: r["chunks"] for name, r in records.items()} == {
        "InterleavedSeq1F1B": 4, "Seq1F1BZeroBubble": 1, "Interleaved1F1B": 4,
    }
    assert records["InterleavedSeq1F1B"]["ranks"][0]["stages"] == [0, 4, 8, 12]
    assert "InterleavedSeq1F1B" in capsys.readouterr().out


def test_cli_all_schedules_default_two_chunks(tmp_path):
    path = tmp_path / "out.json"
    assert main(["--model", "paper-7b", "--seq-len", "4096", "--pp", "4", "-m", "4",
                 "--schedule", "all", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["schedule"] for r in records] == list(SCHEDULES)
    for rec in records:
        assert rec["chunks"] == (2 if SCHEDULE_SPECS[rec["schedule"]].multi_stage else 1)
        assert len(rec["peak_memory_bytes"]) == 4


def test_sim_config_chunks():
    assert _config("InterleavedSeq1F1B", 4, 4).v == 2
    assert _config("Seq1F1B", 4, 4).v == 1
    with pytest.raises(ValueError, match="several stages"):
        _config("InterleavedSeq1F1B", 4, 4, v=1)
    with pytest.raises(ValueError, match="one stage per rank"):
        _config("Seq1F1BZeroBubble", 4, 4, v=2)
    with pytest.raises(ValueError, match="exactly 2"):
        _config("ZBVZeroBubble", 4, 4, v=3)


@pytest.mark.parametrize("argv,message", [
    (["--layers", "4", "--seq-len", "1024", "--pp", "2", "-m", "4"],
     "explicit dims need all of --layers, --dim, --heads (missing --dim, --heads), or use "
     "--model (one of llama3-70b, llama3-8b,"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "0", "-m", "4"], "positive integer"),
    (["--model", "paper-7b", "--seq-len", "x", "--pp", "2", "-m", "4"], "positive integer"),
    (["--model", "gpt-5", "--seq-len", "1024", "--pp", "2", "-m", "4"], "invalid choice"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--schedule", "zb"],
     "unknown schedule"),
    (["--model", "paper-7b", "--layers", "4", "--seq-len", "1024", "--pp", "2", "-m", "4"],
     "not both"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "64", "-m", "4"], "exceeds"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "--tp", "3", "-m", "4"],
     "does not divide"),
    (["--model", "paper-7b", "--seq-len", "1004", "--pp", "2", "--tp", "8", "-m", "4"],
     "multiple of align"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--v", "2"],
     "interleaved"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "-v", "2",
      "--schedule", "Seq1F1B"], "(Seq1F1B) run one stage per rank; drop --chunks"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "-v", "1",
      "--schedule", "InterleavedSeq1F1B"], "--chunks/-v 1: InterleavedSeq1F1B runs several"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "-v", "3",
      "--schedule", "ZBVZeroBubble"], "exactly 2 stages per rank; use 2"),
    (["--layers", "6", "--dim", "64", "--heads", "4", "--seq-len", "64", "--pp", "4", "-m", "2",
      "--schedule", "InterleavedSeq1F1B"], "8 stages exceeds the model's 6 layers"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--p2p-latency", "-1"],
     "number >= 0"),
    (["--layers", "4", "--dim", "100", "--heads", "3", "--seq-len", "64", "--pp", "2", "-m", "2"],
     "not divisible"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--linear-layers",
      "33"], "--linear-layers 33: the model has 32 layers; give at most 32"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--linear-layers",
      "-1"], "argument --linear-layers: expected an integer >= 0, got -1"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--linear-layers",
      "8", "--linear-key-heads", "3"], "n_value_heads=32 must be a multiple of n_key_heads=3"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--cp", "0"],
     "argument --cp: expected a positive integer, got 0"),
    (["--model", "paper-7b", "--seq-len", "1000", "--pp", "2", "-m", "4", "--cp", "3"],
     "cp=3 (CLI: --cp, --seq-len): context parallelism of degree 3 cuts every segment into 6 "
     "pieces, so segment lengths are multiples of 6 and seq_len 1000 is not one; pick a "
     "seq_len divisible by 6 (e.g. 996 or 1002)"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--cp", "2",
      "--cp-bandwidth", "0"], "argument --cp-bandwidth: expected a number > 0, got 0"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_8b_32k_config_and_the_table_has_a_legend(capsys):
    assert main(["--schedule", "all"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model=llama3-8b seq_len=32768 pp=4 tp=1 dp=1 m=8 partition=balanced")
    assert all(f"\n{name} " in out for name in SCHEDULE_SPECS)
    legend = out[out.index("columns:"):]
    for column in ("makespan", "bubble", "equal-cost", "analytic", "peak GiB"):
        assert f"\n  {column} " in legend


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_seq1f1b.simulate", "--paper"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "30B 64xGPU 32k" in result.stdout


def test_a_calibrated_simulation_is_the_planners_estimate():
    unit = UnitTime(2e-6, 1e-9, 1e-4)
    model = TimeModel(
        block=dict.fromkeys("FBIW", unit), head=dict.fromkeys("FBIW", UnitTime(1e-6, 0.0, 0.0)),
        block_activation_bytes=1.0, head_activation_bytes=1.0, kv_bytes=1.0, kv_grad_bytes=1.0,
        runtime=RuntimeOverhead(per_action=3e-4, per_token=1e-7, per_step=2e-3),
    )
    shape = TransformerCost(
        n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64
    )
    config = SimConfig(model=shape, seq_len=256, pp=2, microbatches=2, segments=4,
                       partition="time", time_model=model)
    result = simulate(config)
    pipeline = PipelineShape(
        tuple(config.layers_per_stage()), lambda k: schedule_order(replace(config, segments=k))
    )
    expected = estimate(config.plan(), "time", pipeline, model)
    assert result.makespan == pytest.approx(expected.step_seconds)
    assert result.bubble_fraction == pytest.approx(expected.bubble_fraction)
    assert all(r.busy + r.idle == pytest.approx(result.makespan) for r in result.ranks)
    assert result.segment_lengths == expected.plan.lengths
    with pytest.raises(ValueError, match='partition="time" balances calibrated unit times'):
        SimConfig(model=shape, seq_len=256, pp=2, microbatches=2, partition="time")

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

import dataclasses
import functools
import random
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_seq1f1b.segmenting import nearest_aligned, SegmentPlan, TransformerCost

# The paper's 7B shape: MHA, non-gated MLP.
PAPER_7B = TransformerCost(
    n_layers=32, dim=4096, n_heads=32, n_kv_heads=32,
    ffn_hidden_dim=16384, vocab_size=50304, gated_mlp=False,
)
# Llama-3-8B-like: GQA, SwiGLU.
LLAMA3_8B = TransformerCost(
    n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
    ffn_hidden_dim=14336, vocab_size=128256, gated_mlp=True,
)
# Its shape in qwen3_5's layer pattern: 3 of every 4 layers GatedDeltaNet.
LINEAR_8B = dataclasses.replace(LLAMA3_8B, linear_layers=24)


def spread(plan, cost):
    """(max / mean, min / mean) of per-segment forward FLOPs."""
    flops = plan.segment_flops(cost)
    mean = sum(flops) / len(flops)
    return max(flops) / mean, min(flops) / mean


def assert_valid(plan, seq_len, num_segments, align):
    assert plan.seq_len == seq_len
    assert plan.num_segments == num_segments
    assert sum(plan.lengths) == seq_len
    assert all(n >= align and n % align == 0 for n in plan.lengths)
    assert plan.offsets[0] == 0 and plan.ends[-1] == seq_len
    assert plan.offsets[1:] == plan.ends[:-1]


# ---- cost model -------------------------------------------------------------


def test_forward_flops_matches_a_direct_count():
    cost = TransformerCost(
        n_layers=2, dim=8, n_heads=4, n_kv_heads=2, ffn_hidden_dim=16, vocab_size=10, gated_mlp=True
    )
    s, end, d = 3, 7, 2
    keys = sum(t + 1 for t in range(end - s, end))
    per_layer = 4 * s * 8 * 8 + 4 * s * 8 * 2 * d + 4 * 4 * d * keys + 3 * 2 * s * 8 * 16
    assert cost.forward_flops(s, end) == 2 * per_layer + 2 * s * 8 * 10


def test_forward_flops_with_own_head_dims_and_experts_match_a_direct_count():
    """Qwen3/MLA-style head dims (q/k 6, v 5 with dim 8, 4 heads) and an MoE MLP
    (8 experts of width 16, 2 per token, a shared expert of width 4)."""
    cost = TransformerCost(
        n_layers=2, dim=8, n_heads=4, n_kv_heads=2, ffn_hidden_dim=16, vocab_size=10,
        qk_head_dim=6, v_head_dim=5, experts=8, experts_per_token=2, shared_ffn_hidden_dim=4,
    )
    s, end = 3, 7
    keys = sum(t + 1 for t in range(end - s, end))
    projections = 2 * s * 8 * (4 * 6 + 2 * 6 + 2 * 5 + 4 * 5)  # q, k, v, o
    attention = 2 * 4 * (6 + 5) * keys  # QK^T over d, AV over d_v
    mlp = 3 * 2 * s * 8 * (2 * 16 + 4) + 2 * s * 8 * 8  # active experts + router
    assert cost.forward_flops(s, end) == 2 * (projections + attention + mlp) + 2 * s * 8 * 10
    plan = SegmentPlan.from_lengths([5, 9, 2])
    assert sum(plan.segment_flops(cost)) == cost.forward_flops(16, 16)


def test_sliding_window_layers_count_only_the_keys_inside_the_window():
    """gpt_oss-like: 2 of 4 layers see at most 5 keys (themselves included)."""
    shape = dict(n_layers=4, dim=16, n_heads=4, n_kv_heads=2, ffn_hidden_dim=8, vocab_size=10)
    full = TransformerCost(**shape)
    windowed = TransformerCost(**shape, window_layers=2, window=5)
    per_layer_pair = 2 * 4 * (4 + 4)
    for start, end in [(0, 3), (0, 16), (2, 9), (11, 16)]:
        causal = sum(t + 1 for t in range(start, end))
        inside = sum(min(t + 1, 5) for t in range(start, end))
        assert windowed.attention_flops(end - start, end) == per_layer_pair * 2 * (causal + inside)
        assert full.attention_flops(end - start, end) == per_layer_pair * 4 * causal
    plan = SegmentPlan.from_lengths([5, 9, 2])
    assert sum(plan.segment_flops(windowed)) == windowed.forward_flops(16, 16)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        TransformerCost(**shape, window_layers=1)


def test_linear_attention_layers_cost_per_token_not_per_key():
    """qwen3_5-like: 3 of 4 layers update a (d, d_v) state per token and head instead
    of attending their prefix."""
    shape = dict(n_layers=4, dim=16, n_heads=4, n_kv_heads=2, ffn_hidden_dim=8, vocab_size=10)
    softmax = TransformerCost(**shape)
    linear = TransformerCost(**shape, linear_layers=3)
    per_layer_pair = 2 * 4 * (4 + 4)
    per_layer_token = 4 * 2 * 4 * 4 * 4  # 4 passes over 4 heads' 4 x 4 states, 2 FLOPs an entry
    for start, end in [(0, 3), (0, 16), (2, 9), (11, 16)]:
        causal = sum(t + 1 for t in range(start, end))
        length = end - start
        assert linear.attention_flops(length, end) == per_layer_pair * causal + 3 * per_layer_token * length
        # Projections and MLP are the same in every layer.
        assert softmax.forward_flops(length, end) - linear.forward_flops(length, end) == 3 * (
            per_layer_pair * causal - per_layer_token * length
        )
    plan = SegmentPlan.from_lengths([5, 9, 2])
    assert sum(plan.segment_flops(linear)) == linear.forward_flops(16, 16)
    with pytest.raises(ValueError, match=r"linear_layers=3 must be an int in \[0, 2\]"):
        TransformerCost(**shape, window_layers=2, window=5, linear_layers=3)


def test_balanced_plans_with_linear_attention_are_closer_to_uniform():
    """Linear attention costs the same per token wherever the token is: with fewer softmax
    layers the cost per token grows less along the sequence, and balanced plans flatten
    towards uniform (all of them at no softmax layer)."""
    def skew(plan):
        return max(plan.lengths) / min(plan.lengths)

    for num_segments in (2, 4, 8):
        softmax = SegmentPlan.balanced(32768, num_segments, LLAMA3_8B)
        linear = SegmentPlan.balanced(32768, num_segments, LINEAR_8B)
        assert spread(linear, LINEAR_8B)[0] < 1.01
        assert list(linear.lengths) == sorted(linear.lengths, reverse=True)
        assert 1 < skew(linear) < 1 + (skew(softmax) - 1) / 2, (softmax, linear)
    all_linear = dataclasses.replace(LLAMA3_8B, linear_layers=32)
    assert SegmentPlan.balanced(32768, 4, all_linear) == SegmentPlan.uniform(32768, 4)


@pytest.mark.parametrize("cost", [PAPER_7B, LLAMA3_8B, LINEAR_8B])
@pytest.mark.parametrize(
    "length,end", [(1, 1), (1, 32768), (6215, 32768), (32768, 32768), (777, 1000)]
)
def test_flops_coefficients_reproduce_forward_flops(cost, length, end):
    a, b = cost.flops_coefficients(end)
    assert a < 0
    assert a * length**2 + b * length == pytest.approx(cost.forward_flops(length, end), rel=1e-12)


@pytest.mark.parametrize("cost", [PAPER_7B, LLAMA3_8B, LINEAR_8B])
@pytest.mark.parametrize(
    "plan",
    [
        SegmentPlan.uniform(32768, 4),
        SegmentPlan.uniform(32768, 7, align=128),
        SegmentPlan.balanced(32768, 4, PAPER_7B),
        SegmentPlan.from_lengths([1, 2, 3, 4, 5, 32753]),
    ],
    ids=str,
)
def test_segment_flops_sum_to_whole_sequence(cost, plan):
    assert sum(plan.segment_flops(cost)) == cost.forward_flops(plan.seq_len, plan.seq_len)


def test_gqa_and_gated_mlp_change_cost_as_expected():
    mha = TransformerCost(32, 4096, 32, 32, 14336, 128256, gated_mlp=True)
    gqa = TransformerCost(32, 4096, 32, 8, 14336, 128256, gated_mlp=True)
    plain = TransformerCost(32, 4096, 32, 32, 14336, 128256, gated_mlp=False)
    for length, end in [(1, 1), (4096, 8192), (32768, 32768)]:
        assert gqa.forward_flops(length, end) < mha.forward_flops(length, end)
        assert plain.forward_flops(length, end) < mha.forward_flops(length, end)
    # K/V projections shrink by the GQA ratio; nothing else changes.
    kv_saving = 32 * 4 * 100 * 4096 * (32 - 8) * 128
    assert mha.forward_flops(100, 100) - gqa.forward_flops(100, 100) == kv_saving
    # Per-token work dilutes attention's growth, so GQA and gating shift the split.
    assert SegmentPlan.balanced(32768, 4, LLAMA3_8B) != SegmentPlan.balanced(32768, 4, PAPER_7B)


# ---- balanced plans ---------------------------------------------------------


def test_balanced_7b_32k_matches_paper():
    plan = SegmentPlan.balanced(32768, 4, PAPER_7B)
    assert_valid(plan, 32768, 4, 1)
    high, low = spread(plan, PAPER_7B)
    assert high < 1.01 and low > 0.99
    for ours, paper in zip(plan.lengths, (11021, 8421, 7087, 6239)):
        assert ours == pytest.approx(paper, rel=0.02)


def test_balanced_7b_128k_align8_matches_paper():
    # The paper's example uses TP8 and its approximate formula; shapes still agree.
    plan = SegmentPlan.balanced(131072, 4, PAPER_7B, align=8)
    assert_valid(plan, 131072, 4, 8)
    assert spread(plan, PAPER_7B)[0] < 1.01
    for ours, paper in zip(plan.lengths, (55712, 30872, 24064, 20424)):
        assert ours == pytest.approx(paper, rel=0.03)


def test_uniform_7b_32k_is_unbalanced():
    high, _ = spread(SegmentPlan.uniform(32768, 4), PAPER_7B)
    assert 1.25 <= high <= 1.33


@pytest.mark.parametrize("num_segments", [2, 4, 8])
def test_balanced_gqa_gated_within_one_percent(num_segments):
    plan = SegmentPlan.balanced(32768, num_segments, LLAMA3_8B)
    assert_valid(plan, 32768, num_segments, 1)
    high, low = spread(plan, LLAMA3_8B)
    assert high < 1.01 and low > 0.99
    assert list(plan.lengths) == sorted(plan.lengths, reverse=True)


def test_balanced_respects_align():
    plan = SegmentPlan.balanced(32768, 4, PAPER_7B, align=128)
    assert_valid(plan, 32768, 4, 128)
    high, low = spread(plan, PAPER_7B)
    assert high < 1.02 and low > 0.98


def test_balanced_with_max_segments_gives_all_align():
    plan = SegmentPlan.balanced(1024, 8, PAPER_7B, align=128)
    assert plan.lengths == (128,) * 8


# ---- uniform and user-given plans -------------------------------------------


@pytest.mark.parametrize(
    "seq_len,num_segments,align", [(32768, 4, 1), (1000, 3, 1), (4096, 5, 128), (96, 7, 8)]
)
def test_uniform_is_as_equal_as_possible(seq_len, num_segments, align):
    plan = SegmentPlan.uniform(seq_len, num_segments, align)
    assert_valid(plan, seq_len, num_segments, align)
    assert max(plan.lengths) - min(plan.lengths) <= align
    # Leftover units go to the earliest (cheapest) segments.
    assert list(plan.lengths) == sorted(plan.lengths, reverse=True)


def test_single_segment_and_max_segments():
    assert SegmentPlan.uniform(32768, 1).lengths == (32768,)
    assert SegmentPlan.balanced(32768, 1, PAPER_7B).lengths == (32768,)
    assert SegmentPlan.uniform(1024, 8, align=128).lengths == (128,) * 8
    assert SegmentPlan.uniform(5, 5).lengths == (1,) * 5


def test_offsets_ends_slices_and_str():
    plan = SegmentPlan.from_lengths([11021, 8421, 7087, 6239])
    assert plan.seq_len == 32768 and plan.num_segments == 4
    assert plan.offsets == (0, 11021, 19442, 26529)
    assert plan.ends == (11021, 19442, 26529, 32768)
    assert plan.slices()[1] == slice(11021, 19442)
    assert str(plan) == "SegmentPlan(seq_len=32768, lengths=[11021, 8421, 7087, 6239])"
    assert SegmentPlan(6, [2, 4]).lengths == (2, 4)


# ---- errors -----------------------------------------------------------------


@pytest.mark.parametrize("build", [
    lambda **kw: SegmentPlan.uniform(**kw),
    lambda **kw: SegmentPlan.balanced(cost=PAPER_7B, **kw),
])
@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=1024, num_segments=0), "num_segments=0"),
    (dict(seq_len=0, num_segments=2), "seq_len=0"),
    (dict(seq_len=1024, num_segments=2, align=0), "align=0"),
    (dict(seq_len=1000, num_segments=2, align=128), r"seq_len=1000 is not a multiple of align=128"),
    (dict(seq_len=1000, num_segments=2, align=128), r"pick a seq_len divisible by 128"),
    (dict(seq_len=1024, num_segments=9, align=128), r"at most 8 segments.*num_segments <= 8"),
    (dict(seq_len=1024.0, num_segments=2), "seq_len"),
    (dict(seq_len=1024, num_segments=True), "num_segments"),
])
def test_bad_split_arguments(build, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


def test_balanced_rejects_cost_without_flops():
    with pytest.raises(ValueError, match="cost=.*forward_flops"):
        SegmentPlan.balanced(1024, 2, cost=object())


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_layers=0), "n_layers=0"),
    (dict(dim=-8), "dim=-8"),
    (dict(vocab_size=1.5), "vocab_size"),
    (dict(dim=100), r"dim=100 is not divisible by n_heads=32.*pick n_heads"),
    (dict(n_kv_heads=5), r"n_heads=32 is not divisible by n_kv_heads=5.*pick n_kv_heads"),
])
def test_bad_transformer_shapes(kwargs, match):
    shape = dict(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256
    )
    with pytest.raises(ValueError, match=match):
        TransformerCost(**{**shape, **kwargs})


def test_forward_flops_rejects_segment_outside_prefix():
    with pytest.raises(ValueError, match="length"):
        PAPER_7B.forward_flops(10, 5)
    with pytest.raises(ValueError, match="length"):
        PAPER_7B.forward_flops(0, 5)


@pytest.mark.parametrize("lengths,align,match", [
    ([4, 0, 4], 1, "lengths"),
    ([4, -4], 1, "lengths"),
    ([], 1, "lengths"),
    ([128, 100], 128, r"lengths=.*\[100\] not a multiple of align=128.*e\.g\. \[128, 128\]"),
    ([128], 0, "align=0"),
])
def test_bad_from_lengths(lengths, align, match):
    with pytest.raises(ValueError, match=match):
        SegmentPlan.from_lengths(lengths, align=align)


@pytest.mark.parametrize("lengths,align,nearest", [
    ([5, 9, 2], 4, [4, 8, 4]),  # border 14 -> 12, not 16, which would empty the last
    ([6, 6, 4], 4, [8, 4, 4]),
    ([1, 1, 30], 8, [8, 8, 16]),  # each keeps at least align
    ([1, 1], 8, [8, 8]),  # no room: the total rounds up
    ([4, 8], 4, [4, 8]),
    ([3, 3], 4, [4, 4]),  # a total off the grid rounds up
])
def test_nearest_aligned_lengths_keep_the_total(lengths, align, nearest):
    assert nearest_aligned(lengths, align) == nearest
    assert all(n % align == 0 and n >= align for n in nearest)


def test_plan_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="seq_len=10"):
        SegmentPlan(10, (4, 4))
    with pytest.raises(ValueError, match="lengths"):
        SegmentPlan(8, (8, 0))


# ---- property-style ---------------------------------------------------------


# Attention-dominated toy model: the steepest cost growth, so the hardest to round.
TOY = TransformerCost(n_layers=1, dim=64, n_heads=8, n_kv_heads=1, ffn_hidden_dim=1, vocab_size=1)


def test_random_grid_gives_valid_plan_or_documented_error():
    rng = random.Random(0)
    for _ in range(400):
        align = rng.choice([1, 2, 8, 64, 128])
        seq_len = rng.choice(
            [rng.randint(1, 64), align * rng.randint(1, 300), rng.randint(1, 40000)]
        )
        num_segments = rng.randint(1, 40)
        cost = rng.choice([PAPER_7B, LLAMA3_8B, TOY])
        if seq_len % align or num_segments > seq_len // align:
            with pytest.raises(ValueError, match="seq_len|num_segments"):
                SegmentPlan.uniform(seq_len, num_segments, align)
            with pytest.raises(ValueError, match="seq_len|num_segments"):
                SegmentPlan.balanced(seq_len, num_segments, cost, align)
            continue
        uniform = SegmentPlan.uniform(seq_len, num_segments, align)
        balanced = SegmentPlan.balanced(seq_len, num_segments, cost, align)
        assert_valid(uniform, seq_len, num_segments, align)
        assert_valid(balanced, seq_len, num_segments, align)
        assert max(balanced.segment_flops(cost)) <= max(uniform.segment_flops(cost))


def best_max_flops(seq_len, num_segments, cost, align):
    """Brute force: least possible largest segment cost over all aligned plans."""

    @functools.cache
    def best(units, segments):  # cover [0, units * align) with `segments` segments
        end = units * align
        if segments == 1:
            return cost.forward_flops(end, end)
        return min(
            max(best(start, segments - 1), cost.forward_flops(end - start * align, end))
            for start in range(segments - 1, units)
        )

    return best(seq_len // align, num_segments)


def test_balanced_is_min_max_optimal():
    rng = random.Random(1)
    for _ in range(150):
        align = rng.choice([1, 2, 8])
        seq_len = align * rng.randint(1, 48)
        num_segments = rng.randint(1, min(12, seq_len // align))
        cost = rng.choice([PAPER_7B, LLAMA3_8B, TOY])
        plan = SegmentPlan.balanced(seq_len, num_segments, cost, align)
        assert max(plan.segment_flops(cost)) == best_max_flops(seq_len, num_segments, cost, align)


def test_balanced_beats_rounding_when_align_is_coarse():
    # Rounding the align=1 boundaries to multiples of 128 gives [512, 512, 640, 512, 384, ...],
    # 1.22x the mean cost; here no aligned plan beats the uniform one.
    plan = SegmentPlan.balanced(4096, 8, PAPER_7B, align=128)
    assert plan.lengths == (512,) * 8


def test_imports_without_torch():
    # The package's __init__ imports torch; a bare package object skips it, so
    # only the segmenting modules themselves are imported.
    package_dir = Path(__file__).resolve().parents[2] / "torchtitan_seq1f1b"
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = None\n"
        "package = types.ModuleType('torchtitan_seq1f1b')\n"
        f"package.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['torchtitan_seq1f1b'] = package\n"
        "from torchtitan_seq1f1b.segmenting import nearest_aligned, SegmentPlan, TransformerCost\n"
        "SegmentPlan.balanced(64, 4, TransformerCost(1, 8, 2, 2, 8, 8))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

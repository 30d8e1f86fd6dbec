# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""ScheduleSeq1F1B against unsplit, non-pipelined training, in float64.

Every case runs one training step and one eval() of a small llama-style
transformer on pp gloo ranks and compares gradients, each microbatch's loss
and logits with a single-process, unsplit reference (rtol 1e-10), and each
stage's K/V store peak with the bytes its compute order must hold.

Grid at pp=2: k in 1..4 x m in 1..3 x uniform and balanced plans x MHA and
GQA x activation checkpointing "none" and "full" (the full product); plus a
slice for the other checkpointing modes: "selective_layer" and "selective_op"
each on the balanced plans (k, m) = (2, 3) MHA, (3, 2) GQA and (4, 1) MHA.
At pp=4, where four ranks share two cores, a diagonal of it: every k once
on a balanced plan with MHA and GQA, "none" and "full" in turn, and each
selective mode. Off the main stack (torchtitan 0.2.2) pp=2 runs that diagonal
too: CI's other torch releases need the torch-specific paths, which the
diagonal reaches, and the main stack runs the grid. Every backward runs on a fresh thread (``Case.device_thread``).
"""

import itertools

import pytest
import torch

from torchtitan_seq1f1b import SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import (
    ACTIVATION_CHECKPOINT_MODES,
    TinyTransformerArgs,
)
from torchtitan_seq1f1b.integration import titan_release

from tests.harness import (
    assert_matches_reference,
    Case,
    expected_kv_peak_bytes,
    pipelined,
    pipelined_broken,
    pipelined_cases,
    reference,
    run_ranks,
    worst_relative_grad_error,
)

SEQ_LEN = 30  # balanced plans of the tiny model are uneven from here on
RTOL, ATOL = 1e-10, 1e-14


def _plan(partition: str, num_segments: int, n_kv_heads: int) -> SegmentPlan:
    if partition == "uniform":
        return SegmentPlan.uniform(SEQ_LEN, num_segments)
    cost = TinyTransformerArgs(n_kv_heads=n_kv_heads).cost()
    return SegmentPlan.balanced(SEQ_LEN, num_segments, cost)


def _cases() -> list[Case]:
    cases = []
    for k, m, partition, n_kv_heads, ac in itertools.product(
        (1, 2, 3, 4), (1, 2, 3), ("uniform", "balanced"), (4, 2), ("none", "full")
    ):
        plan = _plan(partition, k, n_kv_heads)
        cases.append(Case(m, plan.lengths, n_kv_heads=n_kv_heads, activation_checkpoint=ac))
    for ac, (k, m, n_kv_heads) in itertools.product(
        ("selective_layer", "selective_op"), ((2, 3, 4), (3, 2, 2), (4, 1, 4))
    ):
        plan = _plan("balanced", k, n_kv_heads)
        cases.append(Case(m, plan.lengths, n_kv_heads=n_kv_heads, activation_checkpoint=ac))
    # The same plan can come from both partitions; run it once.
    return list(dict.fromkeys(cases))


CASES = _cases()
# (k, m, n_kv_heads, activation_checkpoint) on balanced plans: pp=4, and pp=2 off the main stack.
DIAGONAL = [
    Case(m, _plan("balanced", k, n_kv_heads).lengths, n_kv_heads=n_kv_heads, activation_checkpoint=ac)
    for k, m, n_kv_heads, ac in (
        (1, 3, 4, "none"), (2, 1, 2, "full"), (3, 2, 4, "none"), (4, 3, 2, "full"),
        (2, 3, 4, "selective_layer"), (3, 2, 2, "selective_op"), (4, 1, 4, "selective_op"),
    )
]
PP2_CASES = CASES if titan_release() == "0.2" else DIAGONAL


def _case_id(case: Case) -> str:
    lengths = "-".join(map(str, case.lengths))
    attn = "mha" if case.n_kv_heads == 4 else "gqa"
    return f"m{case.n_microbatches}-seg{lengths}-{attn}-ac_{case.activation_checkpoint}"


@pytest.fixture(scope="module")
def pipeline_runs():
    """pp -> {case: per-rank results}, each pp's cases run in one launch when first asked."""
    runs = {}

    def of(pp: int) -> dict:
        if pp not in runs:
            cases = PP2_CASES if pp == 2 else DIAGONAL
            per_rank = run_ranks(pipelined_cases, pp, cases, timeout=900)
            runs[pp] = {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}
        return runs[pp]

    return of


def test_grid_covers_uneven_plans():
    uneven = [c for c in CASES if len(set(c.lengths)) > 1]
    assert {len(c.lengths) for c in uneven} >= {2, 3, 4}


def test_grid_covers_every_checkpointing_mode_with_mha_and_gqa():
    covered = {(c.activation_checkpoint, c.n_kv_heads) for c in CASES if len(c.lengths) > 1}
    assert covered == set(itertools.product(ACTIVATION_CHECKPOINT_MODES, (4, 2)))


@pytest.mark.parametrize(
    "pp, case",
    [(2, case) for case in PP2_CASES] + [(4, case) for case in DIAGONAL],
    ids=lambda x: f"pp{x}" if isinstance(x, int) else _case_id(x),
)
def test_matches_unsplit_reference(pipeline_runs, pp, case):
    ranks = pipeline_runs(pp)[case]
    assert_matches_reference(ranks, case, RTOL, ATOL)

    # Every activation and gradient lands in a buffer of its own segment's length.
    chunk_lens = list(case.lengths) * case.n_microbatches
    for index, rank in enumerate(ranks):
        has_input_recv, has_grad_recv = index > 0, index < len(ranks) - 1
        expected = chunk_lens * has_input_recv + chunk_lens * has_grad_recv
        assert sorted(rank["recv_lens"]) == sorted(expected), "receive buffers not per segment"
        assert rank["kv_left_after_step"] == 0, "K/V of a microbatch outlived its backward"
        assert rank["kv_left_after_eval"] == 0, "eval() left K/V behind"
        for stage, peak in rank["kv_peak_bytes"].items():
            assert peak == expected_kv_peak_bytes(case, rank["segment_order"], stage, pp), stage


def test_external_loss_normalizer_scales_gradients():
    """``loss_normalizer`` (torchtitan's global token count) replaces the step's own."""
    case = Case(2, (12, 10, 8))
    ref = reference(case)
    valid_tokens = int((case.batch()[1] != -100).sum())
    normalizer = 3.0 * valid_tokens
    ranks = run_ranks(pipelined, 2, case, normalizer, timeout=300)
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(
                grad * 3.0, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name
            )
    for loss, expected in zip(ranks[-1]["losses"], ref["loss_sums"]):
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)


def test_reference_comparison_catches_broken_segment_attention():
    """Negative control: the comparison above fails when segments stop seeing each other."""
    case = Case(2, (12, 10, 8))
    ref = reference(case)
    breaks = ("prefix_grads", "prefix_attention")
    per_rank = run_ranks(pipelined_broken, 2, [(case, b) for b in breaks], timeout=300)
    for i, what in enumerate(breaks):
        assert worst_relative_grad_error([rank[i] for rank in per_rank], ref) > 1e-3, what

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Interleaved, zero-bubble and ZB-V Seq1F1B against unsplit training, in float64.

Each case runs one training step and one eval() on pp gloo ranks and compares
gradients, each microbatch's loss and logits with the single-process, unsplit
reference (rtol 1e-10), and each stage's K/V store peak with the bytes its
compute order must hold.

Grid per schedule at pp=2: k in 1..4 x m in {1, 3} on balanced (uneven)
plans, with MHA without checkpointing and GQA with "full"; plus a slice on
the balanced plans (k, m) = (3, 3) and (4, 1): MHA with "full", GQA without,
"selective_layer" (GQA at (3, 3), MHA at (4, 1)) and, for InterleavedSeq1F1B
only, "selective_op" likewise (the split backward of the zero-bubble
variants runs a selective-checkpoint region twice, which torch refuses).
At pp=4, where four ranks share two cores, a diagonal of it: every k once
on a balanced plan, m alternating 3 and 1, MHA without checkpointing and
GQA with "full" in turn, and the selective modes of the slice. Off the main
stack (torchtitan 0.2.2) pp=2 runs the slice alone: CI's other torch releases
need the torch-specific paths, which the slice reaches, and the main stack
runs the grid.
Every backward runs on a fresh thread (``Case.device_thread``).

Negative controls: with the prefix dK/dV routing off, or with the first
stage's W steps running first segment first, the comparison fails.
"""

import itertools

import pytest
import torch

from torchtitan_seq1f1b import SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformerArgs
from torchtitan_seq1f1b.integration import titan_release

from tests.harness import (
    Case,
    expected_kv_peak_bytes,
    pipelined_broken,
    pipelined_cases,
    reference,
    run_ranks,
    worst_relative_grad_error,
)

SEQ_LEN = 30
RTOL, ATOL = 1e-10, 1e-14
# schedule -> stages per rank
VARIANTS = {"InterleavedSeq1F1B": 2, "Seq1F1BZeroBubble": 1, "Seq1F1BZBV": 2}

# Selective op checkpointing allows one backward per region; split backwards run two.
SELECTIVE_OP_SCHEDULES = {"InterleavedSeq1F1B"}

# ((k, m), n_kv_heads, activation_checkpoint) on balanced plans, beyond the grid.
SLICE = [
    ((3, 3), 4, "full"),
    ((4, 1), 4, "full"),
    ((3, 3), 2, "none"),
    ((4, 1), 2, "none"),
    ((3, 3), 2, "selective_layer"),
    ((4, 1), 4, "selective_layer"),
    ((3, 3), 2, "selective_op"),
    ((4, 1), 4, "selective_op"),
]


def _case(schedule: str, pp: int, m: int, lengths, n_kv_heads: int, ac: str) -> Case:
    stages_per_rank = VARIANTS[schedule]
    return Case(
        m,
        lengths,
        n_kv_heads=n_kv_heads,
        activation_checkpoint=ac,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        n_layers=max(4, pp * stages_per_rank),
    )


def _balanced(k: int, n_kv_heads: int) -> tuple[int, ...]:
    cost = TinyTransformerArgs(n_kv_heads=n_kv_heads).cost()
    return SegmentPlan.balanced(SEQ_LEN, k, cost).lengths


SLICE_ONLY = titan_release() != "0.2"

# (k, m, n_kv_heads, activation_checkpoint) at pp=4, on balanced plans.
DIAGONAL = [(1, 3, 4, "none"), (2, 1, 2, "full"), (3, 3, 4, "none"), (4, 1, 2, "full")]


def _cases(schedule: str, pp: int, slice_only: bool = SLICE_ONLY) -> list[Case]:
    if pp == 4:
        return _diagonal(schedule)
    cases = []
    if not slice_only:
        cases = [
            _case(schedule, pp, m, _balanced(k, n_kv_heads), n_kv_heads, ac)
            for k, m, (n_kv_heads, ac) in itertools.product(
                (1, 2, 3, 4), (1, 3), ((4, "none"), (2, "full"))
            )
        ]
    for (k, m), n_kv_heads, ac in SLICE:
        if ac != "selective_op" or schedule in SELECTIVE_OP_SCHEDULES:
            cases.append(_case(schedule, pp, m, _balanced(k, n_kv_heads), n_kv_heads, ac))
    return cases


def _diagonal(schedule: str) -> list[Case]:
    cases = [
        _case(schedule, 4, m, _balanced(k, n_kv_heads), n_kv_heads, ac)
        for k, m, n_kv_heads, ac in DIAGONAL
    ]
    for (k, m), n_kv_heads, ac in SLICE:
        if ac.startswith("selective") and (ac != "selective_op" or schedule in SELECTIVE_OP_SCHEDULES):
            cases.append(_case(schedule, 4, m, _balanced(k, n_kv_heads), n_kv_heads, ac))
    return cases


RUNS = [(schedule, pp) for schedule in VARIANTS for pp in (2, 4)]


@pytest.fixture(scope="module", params=RUNS, ids=lambda run: f"{run[0]}-pp{run[1]}")
def variant_runs(request):
    schedule, pp = request.param
    cases = _cases(schedule, pp)
    per_rank = run_ranks(pipelined_cases, pp, cases, timeout=900)
    return cases, [[rank[i] for rank in per_rank] for i in range(len(cases))]


def test_grid_covers_uneven_plans():
    for schedule in VARIANTS:
        uneven = [c for c in _cases(schedule, 2, slice_only=False) if len(set(c.lengths)) > 1]
        assert {len(c.lengths) for c in uneven} >= {2, 3, 4}


@pytest.mark.parametrize("schedule", VARIANTS)
def test_grid_covers_checkpointing_modes_with_mha_and_gqa(schedule):
    modes = {"none", "full", "selective_layer"} | (
        {"selective_op"} if schedule in SELECTIVE_OP_SCHEDULES else set()
    )
    covered = {
        (c.activation_checkpoint, c.n_kv_heads)
        for c in _cases(schedule, 2, slice_only=False)
        if len(set(c.lengths)) > 1
    }
    assert covered == set(itertools.product(modes, (4, 2)))


def test_matches_unsplit_reference(variant_runs):
    cases, runs = variant_runs
    for case, ranks in zip(cases, runs):
        where = f"{case}"
        ref = reference(case)
        grads = {}
        for rank in ranks:
            assert not grads.keys() & rank["grads"].keys()
            grads.update(rank["grads"])
        assert grads.keys() == ref["grads"].keys(), where
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=f"{where} {name}"
            )
        last = next(rank for rank in ranks if rank["logits"] is not None)
        assert len(last["losses"]) == case.n_microbatches, where
        for microbatch, (loss, expected) in enumerate(zip(last["losses"], ref["loss_sums"])):
            torch.testing.assert_close(
                loss, expected, rtol=RTOL, atol=0, msg=f"{where} microbatch {microbatch}"
            )
        torch.testing.assert_close(last["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
        num_stages = len(ranks) * case.stages_per_rank
        for rank in ranks:
            assert rank["kv_left_after_step"] == 0, f"{where}: K/V outlived the step"
            assert rank["kv_left_after_eval"] == 0, f"{where}: eval() left K/V behind"
            for stage, peak in rank["kv_peak_bytes"].items():
                expected = expected_kv_peak_bytes(case, rank["segment_order"], stage, num_stages)
                assert peak == expected, f"{where}: stage {stage} K/V peak"


NEGATIVE_CONTROLS = [
    (schedule, what)
    for schedule in VARIANTS
    for what in ("prefix_grads", "w_order")
    if what != "w_order" or schedule != "InterleavedSeq1F1B"  # no W steps
]


def test_reference_comparison_catches_broken_variants():
    """Negative controls: prefix dK/dV dropped, or the first stage's W steps
    (which hold its whole backward) run first segment first."""
    runs = [(_case(schedule, 2, 2, (12, 10, 8), 4, "none"), what) for schedule, what in NEGATIVE_CONTROLS]
    per_rank = run_ranks(pipelined_broken, 2, runs, timeout=600)
    for i, (case, what) in enumerate(runs):
        worst = worst_relative_grad_error([rank[i] for rank in per_rank], reference(case))
        assert worst > 1e-3, f"{case.schedule} {what}: {worst}"

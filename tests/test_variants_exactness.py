# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Interleaved, zero-bubble and ZB-V Seq1F1B against unsplit training, in float64.

Each case runs one training step and one eval() on pp gloo ranks and compares
gradients, per-microbatch losses and logits with the single-process, unsplit
reference (rtol 1e-10): k in 1..4, uniform and uneven plans, MHA and GQA,
activation checkpointing on and off.
"""

import itertools

import pytest
import torch

from torchtitan_seq1f1b import SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformerArgs

from tests.harness import Case, pipelined_cases, reference, run_ranks

SEQ_LEN = 30
RTOL, ATOL = 1e-10, 1e-14
# schedule -> stages per rank
VARIANTS = {"InterleavedSeq1F1B": 2, "Seq1F1BZeroBubble": 1, "Seq1F1BZBV": 2}


def _cases(schedule: str, pp: int) -> list[Case]:
    stages_per_rank = VARIANTS[schedule]
    cases = []
    for k, m, (n_kv_heads, ac) in itertools.product(
        (1, 2, 3, 4), (1, 3), ((4, "none"), (2, "full"))
    ):
        cost = TinyTransformerArgs(n_kv_heads=n_kv_heads).cost()
        plans = {SegmentPlan.uniform(SEQ_LEN, k).lengths, SegmentPlan.balanced(SEQ_LEN, k, cost).lengths}
        cases += [
            Case(
                m,
                lengths,
                n_kv_heads=n_kv_heads,
                activation_checkpoint=ac,
                schedule=schedule,
                stages_per_rank=stages_per_rank,
                n_layers=max(4, pp * stages_per_rank),
            )
            for lengths in sorted(plans)
        ]
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
        uneven = [c for c in _cases(schedule, 2) if len(set(c.lengths)) > 1]
        assert {len(c.lengths) for c in uneven} >= {2, 3, 4}


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
        torch.testing.assert_close(sum(last["losses"]), ref["loss_sum"], rtol=RTOL, atol=0)
        torch.testing.assert_close(last["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
        for rank in ranks:
            assert rank["kv_left_after_step"] == 0, f"{where}: K/V outlived the step"
            assert rank["kv_left_after_eval"] == 0, f"{where}: eval() left K/V behind"

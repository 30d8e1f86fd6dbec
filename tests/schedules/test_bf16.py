# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B and its variants in bf16, the dtype users train in.

Float64 exactness (test_exactness.py, test_variants_exactness.py) proves the
schedules compute the unsplit gradients. In bf16 they round differently from
unsplit training (``param.grad`` accumulates over the m*k units in bf16, and
every segment's attention runs its own kernels over its prefix), and that
must cost little next to what bf16 itself costs. One step of every schedule
(pp=2, m=2, the balanced, uneven plan of 128 tokens in 4 segments, full
activation checkpointing, every backward on a fresh thread) is compared with
the unsplit float64 step from the same weights (the bf16 weights, exactly):

    error(g) = ||g - g64|| / ||g64||, 2-norms over all parameter gradients at once,

    error(pipelined bf16) <= 1.5 * error(unsplit bf16).

The prefix dK/dV banks, summed over up to k segments, must be fp32; and the
bound fails when the prefix gradients are not routed (negative control).
"""

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from torchtitan_seq1f1b import kv_store, SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformerArgs

from tests.harness import Case, pipelined, pipelined_broken, reference, run_ranks, SCHEDULES

RATIO_BOUND = 1.5
LENGTHS = SegmentPlan.balanced(128, 4, TinyTransformerArgs().cost()).lengths
STAGES_PER_RANK = {"Seq1F1B": 1, "InterleavedSeq1F1B": 2, "Seq1F1BZeroBubble": 1, "Seq1F1BZBV": 2}


def _case(schedule: str) -> Case:
    return Case(
        2,
        LENGTHS,
        activation_checkpoint="full",
        schedule=schedule,
        stages_per_rank=STAGES_PER_RANK[schedule],
        dtype=torch.bfloat16,
    )


CASES = [_case(schedule) for schedule in SCHEDULES]
BROKEN = (_case("Seq1F1B"), "prefix_grads")


@contextlib.contextmanager
def _recorded_bank_dtypes(dtypes: set) -> Iterator[None]:
    """Add the dtype of every prefix dK/dV bank the K/V stores use to ``dtypes``."""
    take_grads = kv_store._PrefixBuffers.take_grads

    def recording(self, *args):
        own = take_grads(self, *args)
        if self.grad_k is not None:
            dtypes.update({self.grad_k.dtype, self.grad_v.dtype})
        return own

    with mock.patch.object(kv_store._PrefixBuffers, "take_grads", recording):
        yield


def _bf16_runs(rank: int, world_size: int, cases: list[Case], broken: tuple) -> list[dict]:
    results = []
    for case in cases:
        dtypes: set = set()
        with _recorded_bank_dtypes(dtypes):
            results.append(pipelined(rank, world_size, case) | {"bank_dtypes": dtypes})
    return results + pipelined_broken(rank, world_size, [broken])


@pytest.fixture(scope="module")
def runs():
    per_rank = run_ranks(_bf16_runs, 2, CASES, BROKEN, timeout=900)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES) + 1)]


def relative_error(grads: dict, exact: dict) -> float:
    """||g - g64|| / ||g64|| over all parameters, in float64."""
    error = sum(((g.double() - exact[n]) ** 2).sum() for n, g in grads.items())
    norm = sum((exact[n] ** 2).sum() for n in grads)
    return (error / norm).sqrt().item()


def _grads(ranks: list[dict]) -> dict:
    return {n: g for rank in ranks for n, g in rank["grads"].items()}


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: CASES[i].schedule)
def test_bf16_error_within_1_5x_of_unsplit_bf16(runs, index):
    case = CASES[index]
    exact = reference(case, torch.float64)["grads"]
    unsplit = relative_error(reference(case)["grads"], exact)
    grads = _grads(runs[index])
    assert grads.keys() == exact.keys()
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    pipelined_error = relative_error(grads, exact)
    assert pipelined_error <= RATIO_BOUND * unsplit, (pipelined_error, unsplit)


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: CASES[i].schedule)
def test_prefix_grad_banks_are_fp32(runs, index):
    for rank in runs[index]:
        assert rank["bank_dtypes"] == {torch.float32}


def test_bound_catches_unrouted_prefix_grads(runs):
    """Negative control: without the prefix dK/dV the bound fails."""
    case, _ = BROKEN
    exact = reference(case, torch.float64)["grads"]
    unsplit = relative_error(reference(case)["grads"], exact)
    assert relative_error(_grads(runs[-1]), exact) > RATIO_BOUND * unsplit

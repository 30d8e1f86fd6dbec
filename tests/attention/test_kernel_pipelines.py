# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipelined Seq1F1B runs through each GPU kernel adapter, in float64.

Schedule, K/V store and adapter together: every attention layer of every
stage calls the flash-attn, torch flash or mask-free exact CUDA adapter,
which reaches its kernel's CPU stand-in (tests/kernel_fakes.py). A
representative slice of the exactness grid per adapter: uneven plans, GQA
and MHA, activation checkpointing with backward on a fresh thread, a
split-backward and an interleaved variant, and packed documents (where the
varlen adapters call their kernels' varlen entry points); compared with the
unsplit exact reference like tests/schedules/test_exactness.py (rtol 1e-10).
"""

import pytest
import torch

from tests.harness import Case, pipelined_cases, reference, run_ranks

RTOL, ATOL = 1e-10, 1e-14
KERNELS = ("flash", "varlen", "cuda_exact")


def _cases(kernel: str) -> list[Case]:
    return [
        Case(2, (12, 10, 8), n_kv_heads=2, activation_checkpoint="full", kernel=kernel),
        Case(3, (9, 7, 7, 7), n_kv_heads=4, activation_checkpoint="selective_layer",
             schedule="Seq1F1BZeroBubble", kernel=kernel),
        Case(1, (16, 14), n_kv_heads=1, schedule="InterleavedSeq1F1B", stages_per_rank=2,
             kernel=kernel),
        Case(2, (12, 10, 8), n_kv_heads=2, activation_checkpoint="full", kernel=kernel,
             documents=((4, 13, 2, 11), (30,), (1,) * 30)),
        Case(2, (9, 7, 7, 7), n_kv_heads=4, schedule="Seq1F1BZBV", stages_per_rank=2,
             kernel=kernel, documents=((9, 7, 3, 11), (2, 25, 3))),
    ]


CASES = [case for kernel in KERNELS for case in _cases(kernel)]


@pytest.fixture(scope="module")
def runs():
    per_rank = run_ranks(pipelined_cases, 2, CASES, timeout=600)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{c.kernel}-{c.schedule}-kv{c.n_kv_heads}-{c.activation_checkpoint}"
        f"{'-documents' if c.documents else ''}"
    ),
)
def test_pipelined_through_adapter_matches_unsplit(runs, case):
    ranks = runs[case]
    ref = reference(case)
    grads = {name: g for rank in ranks for name, g in rank["grads"].items()}
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    last = next(rank for rank in ranks if rank["logits"] is not None)
    torch.testing.assert_close(sum(last["losses"]), ref["loss_sum"], rtol=RTOL, atol=0)
    torch.testing.assert_close(last["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
    assert all(rank["kv_left_after_step"] == rank["kv_left_after_eval"] == 0 for rank in ranks)
    # every layer of every segment went through the adapter, recomputes included
    layers = case.model_args.n_layers
    units = case.n_microbatches * len(case.lengths)
    assert sum(rank["kernel_calls"] for rank in ranks) >= layers * units

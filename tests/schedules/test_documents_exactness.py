# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Packed documents under every Seq1F1B schedule, against unsplit training in float64.

The reference is the unsplit model with an explicit (batch, 1, L, L)
block-causal mask (``ExplicitDocumentAttention``); the pipelined runs get the
document ids through ``document_ids_kwarg`` on every rank. Layouts (seq_len
24, per row document lengths; rows of a microbatch take them in turn):

- ``crossing``: documents crossing one and several segment borders, next to
  a row holding one document over every segment;
- ``short``: documents shorter than a segment, and a row of one-token ones;
- ``aligned``: document borders on segment borders (no segment reads back),
  next to a row whose first document spans every segment.

Each case compares gradients, per-microbatch losses and eval logits (rtol
1e-10) and each stage's K/V store peak with what its order must hold when
only the keys a later segment reads back are kept. Backward runs on a fresh
thread, as on CUDA. Sliding windows (every other layer, as gpt_oss) run
against a banded explicit mask, and their stages keep less than full ones.
"""

import dataclasses
import itertools

import pytest
import torch

from torchtitan_seq1f1b.examples.tiny_transformer import ACTIVATION_CHECKPOINT_MODES

from tests.harness import (
    Case,
    expected_kv_peak_bytes,
    pipelined_broken,
    pipelined_cases,
    reference,
    run_ranks,
    SCHEDULES,
    worst_relative_grad_error,
)

RTOL, ATOL = 1e-10, 1e-14
LAYOUTS = {
    "crossing": ((3, 11, 10), (24,)),
    "short": ((2, 3, 1, 4, 2, 5, 3, 4), (1,) * 24),
    "aligned": ((10, 6, 8), (20, 4)),
}
PLANS = {"uneven": (10, 6, 8), "uniform": (6, 6, 6, 6)}


def _cases() -> list[Case]:
    cases = [
        Case(2, PLANS[plan], documents=LAYOUTS[layout], n_kv_heads=kv, activation_checkpoint=ac)
        for (layout, plan, kv, ac) in [
            ("crossing", "uneven", 4, "none"),
            ("crossing", "uniform", 2, "full"),
            ("short", "uneven", 2, "selective_layer"),
            ("short", "uniform", 4, "selective_op"),
            ("aligned", "uneven", 4, "full"),
            ("aligned", "uniform", 2, "none"),
        ]
    ]
    for schedule, layout in itertools.product(
        ("InterleavedSeq1F1B", "Seq1F1BZeroBubble", "Seq1F1BZBV"), ("crossing", "short")
    ):
        cases.append(
            Case(
                3, PLANS["uneven"], documents=LAYOUTS[layout], n_kv_heads=2,
                activation_checkpoint="full", schedule=schedule,
                stages_per_rank=1 if schedule == "Seq1F1BZeroBubble" else 2,
            )
        )
    return cases


CASES = _cases()


def _case_id(case: Case) -> str:
    layout = next(name for name, rows in LAYOUTS.items() if rows == case.documents)
    plan = next(name for name, lengths in PLANS.items() if lengths == case.lengths)
    attn = "mha" if case.n_kv_heads == 4 else "gqa"
    return f"{case.schedule}-{layout}-{plan}-{attn}-ac_{case.activation_checkpoint}"


@pytest.fixture(scope="module")
def pipeline_runs():
    """Every case of this module, sliding windows included, in one launch."""
    cases = CASES + WINDOW_CASES
    per_rank = run_ranks(pipelined_cases, 2, cases, timeout=900)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}


def test_grid_covers_every_schedule_and_checkpointing_mode():
    assert {c.schedule for c in CASES} == set(SCHEDULES)
    assert {c.activation_checkpoint for c in CASES} == set(ACTIVATION_CHECKPOINT_MODES)
    assert {c.n_kv_heads for c in CASES} == {2, 4}


def _assert_matches_reference(ranks: list[dict], case: Case) -> None:
    """Gradients, per-microbatch losses and eval logits equal the unsplit reference's,
    and every store is empty after the step and after eval."""
    ref = reference(case)
    grads = {n: g for rank in ranks for n, g in rank["grads"].items()}
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    last = next(rank for rank in ranks if rank["logits"] is not None)
    for microbatch, (loss, expected) in enumerate(zip(last["losses"], ref["loss_sums"])):
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0, msg=f"microbatch {microbatch}")
    torch.testing.assert_close(last["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
    for rank in ranks:
        assert rank["kv_left_after_step"] == 0 and rank["kv_left_after_eval"] == 0


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_block_causal_reference(pipeline_runs, case):
    ranks = pipeline_runs[case]
    _assert_matches_reference(ranks, case)
    for rank in ranks:
        for stage, peak in rank["kv_peak_bytes"].items():
            num_stages = len(ranks) * case.stages_per_rank
            assert peak == expected_kv_peak_bytes(case, rank["segment_order"], stage, num_stages)


def test_documents_keep_less_kv_than_causal(pipeline_runs):
    """Short documents are read back from a later position than 0, so stores hold less."""
    case = next(c for c in CASES if c.documents == LAYOUTS["short"])
    causal = Case(case.n_microbatches, case.lengths, n_kv_heads=case.n_kv_heads)
    for rank in pipeline_runs[case]:
        for stage, peak in rank["kv_peak_bytes"].items():
            assert peak < expected_kv_peak_bytes(causal, rank["segment_order"], stage, 2)


# Sliding windows (every other layer) of 5 earlier keys, crossing segment borders, with
# and without documents. The reference masks the band explicitly.
WINDOW_CASES = [
    Case(2, PLANS["uneven"], n_kv_heads=2, window_left=5),
    Case(2, PLANS["uneven"], documents=LAYOUTS["crossing"], n_kv_heads=2, window_left=5,
         activation_checkpoint="full"),
    Case(3, PLANS["uneven"], documents=LAYOUTS["crossing"], n_kv_heads=2, window_left=5,
         activation_checkpoint="selective_op", schedule="InterleavedSeq1F1B", stages_per_rank=2),
    # A weight-gradient step recomputes the checkpointed forward after the input-gradient
    # step: the tail must still be there.
    Case(2, PLANS["uneven"], n_kv_heads=2, window_left=5, activation_checkpoint="full",
         schedule="Seq1F1BZeroBubble"),
]


@pytest.mark.parametrize(
    "case", WINDOW_CASES,
    ids=["Seq1F1B-causal", "Seq1F1B-crossing-ac_full", "Interleaved-crossing", "ZB-H1-ac_full"],
)
def test_sliding_windows_match_the_banded_reference_and_keep_less(pipeline_runs, case):
    ranks = pipeline_runs[case]
    _assert_matches_reference(ranks, case)
    full = dataclasses.replace(case, window_left=None)
    num_stages = len(ranks) * case.stages_per_rank
    for rank in ranks:
        for stage, peak in rank["kv_peak_bytes"].items():
            expected = expected_kv_peak_bytes(full, rank["segment_order"], stage, num_stages)
            layers = range(stage * case.n_layers // num_stages, (stage + 1) * case.n_layers // num_stages)
            windowed = any(layer in case.model_args.window_layers for layer in layers)
            assert peak < expected if windowed else peak == expected, f"stage {stage}"


def test_comparison_fails_without_the_document_mask():
    """Negative control: a schedule that drops the ids runs causal attention and differs."""
    case = CASES[0]
    per_rank = run_ranks(pipelined_broken, 2, [(case, "document_mask")], timeout=300)
    assert worst_relative_grad_error([rank[0] for rank in per_rank], reference(case)) > 1e-3

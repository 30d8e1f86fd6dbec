# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A qwen3_5-shaped model (GatedDeltaNet layers between softmax ones) under every
Seq1F1B schedule, against unsplit training in float64.

Layer i is softmax attention when ``(i + 1) % interval == 0``, else GatedDeltaNet,
whose conv tail and recurrent state cross every segment cut through the stage's K/V
store. At pp = 2 (4 layers: one per stage under the interleaved and V schedules),
interval 2 and qwen3_5's 4, on uneven plans, one with a segment shorter than the
conv tail; packed documents crossing cuts; checkpointing "full", "selective_layer"
and "selective_op"; split backwards (zero-bubble, ZB-V) whose weight-gradient steps
recompute checkpointed segments after the input-gradient steps; every backward on a
fresh thread. Every parameter gradient, each microbatch's loss and the eval logits
equal the unsplit reference's (rtol 1e-10), and no carry outlives the step.

Negative control: every segment's GatedDeltaNet starting from a zero state and a
zero conv tail, as a layer that kept nothing across cuts would, must fail.
"""

from unittest import mock

import pytest
import torch

from torchtitan_seq1f1b.examples.tiny_transformer import ACTIVATION_CHECKPOINT_MODES
from torchtitan_seq1f1b.linear_attention.carry import Carry

from tests.harness import Case, cases_and_control, pipelined, reference, SCHEDULES

RTOL, ATOL = 1e-10, 1e-14
UNEVEN = (7, 4, 5)
SHORT_MIDDLE = (7, 2, 7)  # its middle segment is shorter than the conv's 3-token tail
# Per row: a document across cuts 7 and 11 (or 7 and 9) beside a row that is one
# document; short documents, one starting at cut 7.
CROSSING = ((5, 8, 3), (16,))
SHORT = ((2, 5, 1, 6, 2),)


def _case(schedule: str, lengths, interval: int, documents=None, ac: str = "none") -> Case:
    return Case(
        2,
        lengths,
        n_kv_heads=2,
        activation_checkpoint=ac,
        schedule=schedule,
        stages_per_rank=2 if schedule in ("InterleavedSeq1F1B", "Seq1F1BZBV") else 1,
        documents=documents,
        linear_attention_interval=interval,
    )


CASES = [
    _case("Seq1F1B", UNEVEN, 2),
    _case("Seq1F1B", SHORT_MIDDLE, 4, CROSSING, "full"),
    _case("Seq1F1B", UNEVEN, 2, SHORT, "selective_op"),
    _case("InterleavedSeq1F1B", UNEVEN, 4, CROSSING, "selective_layer"),
    _case("Seq1F1BZeroBubble", SHORT_MIDDLE, 2, CROSSING, "full"),
    _case("Seq1F1BZBV", UNEVEN, 4, SHORT, "selective_layer"),
]
CONTROL = CASES[1]
# Worst max|found - expected| / max|expected| over each case's gradients, losses, logits.
WORST: dict[str, float] = {}


def _case_id(case: Case) -> str:
    documents = {None: "causal", CROSSING: "crossing", SHORT: "short"}[case.documents]
    lengths = "-".join(map(str, case.lengths))
    return (
        f"{case.schedule}-seg{lengths}-interval{case.linear_attention_interval}-{documents}"
        f"-ac_{case.activation_checkpoint}"
    )


def _forgetful_incoming(self, segment):
    return None


def _forgetful():
    """Every segment starts from a zero conv tail and state."""
    return mock.patch.object(Carry, "incoming", _forgetful_incoming)


@pytest.fixture(scope="module")
def pipeline_runs():
    """Every case, then the negative control, in one launch: {case or "control": ranks}."""
    yield cases_and_control(pipelined, CASES, CONTROL, _forgetful)
    for name, err in WORST.items():
        print(f"\n{name}: worst relative error {err:.2e}")


def _relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found - expected).abs().max() / expected.abs().max()).item()


def _errors(ranks: list[dict], case: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (pipelined, reference): every parameter gradient, the per-microbatch
    losses and the eval logits."""
    ref = reference(case)
    grads = {n: g for rank in ranks for n, g in rank["grads"].items()}
    assert grads.keys() == ref["grads"].keys()
    last = next(rank for rank in ranks if rank["logits"] is not None)
    pairs = {name: (grad, ref["grads"][name]) for name, grad in grads.items()}
    pairs["losses"] = (torch.stack(last["losses"]), torch.stack(ref["loss_sums"]))
    pairs["logits"] = (last["logits"], ref["logits"])
    return pairs


def test_cases_cover_every_schedule_and_checkpointing_mode():
    assert {c.schedule for c in CASES} == set(SCHEDULES)
    assert {c.activation_checkpoint for c in CASES} == set(ACTIVATION_CHECKPOINT_MODES)
    assert {c.linear_attention_interval for c in CASES} == {2, 4}
    for case in CASES:
        layers = case.model_args.linear_layers
        assert 0 < len(layers) < case.n_layers, "GatedDeltaNet and softmax layers both"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_unsplit_reference(pipeline_runs, case):
    ranks = pipeline_runs[case]
    pairs = _errors(ranks, case)
    for name, (found, expected) in pairs.items():
        torch.testing.assert_close(found, expected, rtol=RTOL, atol=ATOL, msg=name)
    WORST[_case_id(case)] = max(_relative(*pair) for pair in pairs.values())
    for rank in ranks:
        assert rank["kv_left_after_step"] == 0 and rank["kv_left_after_eval"] == 0


def test_resetting_the_state_and_tail_at_every_segment_fails(pipeline_runs):
    """Negative control: segments that start from zeros are far from the reference."""
    pairs = _errors(pipeline_runs["control"], CONTROL)
    worst = max(_relative(*pair) for pair in pairs.values())
    WORST["control (reset at every segment)"] = worst
    assert worst > 1e-3

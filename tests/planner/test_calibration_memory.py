# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What calibration holds on a device, computed from shapes: long sequences fit.

At 128k tokens a llama3-8B head's full-sequence logits and their fp32
copies would take 168 GB; the head is timed over fewer tokens instead, and a
rank's chained blocks are cut to what the memory budget holds.
"""

import dataclasses
import importlib

import torch

from torchtitan_seq1f1b.planner.auto import AutoPlanRequest, calibration_target
from torchtitan_seq1f1b.planner.calibrate import (
    calibration_bytes,
    CalibrationTarget,
    HEAD_LOGITS_BYTES,
    head_tokens,
)
from torchtitan_seq1f1b.planner.time_model import NOT_CHARGED, TimeModel
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B
from torchtitan_seq1f1b.segmenting import TransformerCost
from torchtitan_seq1f1b.tools.model_shapes import get_preset

calibration = importlib.import_module("torchtitan_seq1f1b.planner.calibrate")
GIB = 2**30
LLAMA3_8B = get_preset("llama3-8b")
SEQ_128K = 131072


def _request(budget_gib: float | None, num_ranks: int = 8) -> AutoPlanRequest:
    return AutoPlanRequest(
        shape=LLAMA3_8B, seq_len=SEQ_128K, num_ranks=num_ranks, stages_per_rank=1,
        microbatches=2 * num_ranks, order_for=ScheduleSeq1F1B.order_for, device="cuda",
        dtype=torch.bfloat16, budget_bytes=None if budget_gib is None else int(budget_gib * GIB),
    )


def test_the_head_is_timed_over_tokens_whose_logits_fit():
    target = CalibrationTarget(LLAMA3_8B, SEQ_128K, device="cuda", dtype=torch.bfloat16)
    full = SEQ_128K * LLAMA3_8B.vocab_size * (2 + 8)
    assert full > 150 * GIB
    tokens = head_tokens(target)
    assert tokens < SEQ_128K and SEQ_128K % tokens == 0
    assert calibration_bytes(target)["head"] <= HEAD_LOGITS_BYTES < 2 * calibration_bytes(target)["head"]
    small = dataclasses.replace(target, shape=dataclasses.replace(LLAMA3_8B, vocab_size=256))
    assert head_tokens(small) == SEQ_128K


def test_the_chain_is_cut_to_the_budget_at_128k():
    assert calibration_target(_request(None)).chained_blocks == 4
    target = calibration_target(_request(60))
    assert 1 <= target.chained_blocks < 4
    assert sum(calibration_bytes(target).values()) <= 60 * GIB
    more = dataclasses.replace(target, chained_blocks=target.chained_blocks + 1)
    assert sum(calibration_bytes(more).values()) > 60 * GIB
    # never below one block: the recommendation then reports that no plan fits
    assert calibration_target(_request(1)).chained_blocks == 1


def test_a_cpu_calibration_times_the_head_over_fewer_tokens(monkeypatch):
    shape = TransformerCost(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                            vocab_size=512)
    target = CalibrationTarget(shape, 256, repeats=1)
    timed = []
    measure = calibration._measure
    monkeypatch.setattr(calibration, "HEAD_LOGITS_BYTES", 64 * 512 * 12)
    monkeypatch.setattr(
        calibration, "_measure",
        lambda component, target, extra, seq_len: timed.append(seq_len)
        or measure(component, target, extra, seq_len),
    )
    model = calibration.calibrate(target)
    assert timed == [256, 64]  # the blocks over the sequence, the head over 64 tokens
    # priced per token, the head extrapolates to the whole sequence
    assert model.head["F"](256, 256) > model.head["F"](64, 64) > 0


def test_the_plan_log_says_what_the_time_model_leaves_out():
    model = TimeModel(block={}, head={}, block_activation_bytes=0, head_activation_bytes=0,
                      kv_bytes=0, kv_grad_bytes=0)
    assert model.describe() == f"runtime cost not charged; {NOT_CHARGED}"
    assert "recompute under activation checkpointing" in NOT_CHARGED
    assert "FSDP's gradient accumulation" in NOT_CHARGED

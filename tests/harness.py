# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the multi-process exactness tests import: cases, the unsplit reference,
pipelined runs (:mod:`torchtitan_seq1f1b.check.exactness`), optionally through a GPU
kernel's CPU stand-in, and the gloo launcher."""

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch

from torchtitan_seq1f1b import kv_store
from torchtitan_seq1f1b.check import exactness
from torchtitan_seq1f1b.schedule import runtime as schedule_runtime
from torchtitan_seq1f1b.check.launch import RankFailure, run_ranks
from torchtitan_seq1f1b.check.exactness import reference, SCHEDULES
from torchtitan_seq1f1b.actions import Order

from tests.kernel_fakes import stand_in_backend

__all__ = [
    "BREAKS",
    "Case",
    "RankFailure",
    "SCHEDULES",
    "broken",
    "expected_kv_peak_bytes",
    "pipelined",
    "pipelined_broken",
    "pipelined_cases",
    "reference",
    "run_ranks",
    "worst_relative_grad_error",
]


@dataclass(frozen=True)
class Case(exactness.Case):
    # "exact", or a GPU kernel's adapter run through its CPU stand-in
    # ("flash", "varlen", "cuda_exact"; see tests/kernel_fakes.py).
    kernel: str = "exact"


def pipelined(rank: int, world_size: int, case: Case, loss_normalizer: float | None = None) -> dict:
    """:func:`torchtitan_seq1f1b.check.exactness.pipelined`; through a stand-in
    kernel, the result also counts the attention calls that reached it
    (``kernel_calls``, training step and eval)."""
    if case.kernel == "exact":
        return exactness.pipelined(rank, world_size, case, loss_normalizer)
    backend, stand_in = stand_in_backend(case.kernel)
    result = exactness.pipelined(rank, world_size, case, loss_normalizer, backend)
    result["kernel_calls"] = len(stand_in.calls)
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]


def expected_kv_peak_bytes(case: Case, order: Order, stage_index: int, num_stages: int) -> int:
    """The K/V store peak of one stage, replayed from the schedule's compute order.

    What the store must hold, independently of how it does so: per attention
    layer of the stage and per microbatch, from the microbatch's first
    forward until the backward of its segment 0 has run,

    - K and V of the whole sequence, two (microbatch_size, seq_len,
      n_kv_heads, head_dim) tensors in the model's dtype;
    - with k > 1, from the first backward of a later segment (whose prefix
      gradients must wait for earlier segments): dK and dV of the prefix,
      two (microbatch_size, offsets[-1], n_kv_heads, head_dim) tensors in
      fp32 or wider.

    A unit's backward is its B step, or its I step -- except on the first
    stage, where torch runs the whole backward in the W step; K/V go after
    segment 0's B or W step.
    """
    args = case.model_args
    n_layers = len(case.model().stage(stage_index, num_stages).layers)
    per_token = case.microbatch_size * args.n_kv_heads * (args.dim // args.n_heads)
    grad_dtype = torch.promote_types(case.dtype, torch.float32)
    kv_bytes = 2 * n_layers * per_token * case.plan.seq_len * case.dtype.itemsize
    bank_bytes = 2 * n_layers * per_token * case.plan.offsets[-1] * grad_dtype.itemsize
    with_kv, with_bank = set(), set()
    peak = 0
    for action in (a for actions in order.values() for a in actions if a.stage == stage_index):
        microbatch, segment = action.unit
        runs_backward = action.kind == "B" or (
            action.kind in "IW" and (action.kind == "I") == (stage_index > 0)
        )
        if action.kind == "F":
            with_kv.add(microbatch)
        elif runs_backward and segment > 0:
            with_bank.add(microbatch)
        peak = max(peak, len(with_kv) * kv_bytes + len(with_bank) * bank_bytes)
        if action.kind in "BW" and segment == 0:
            with_kv.discard(microbatch)
            with_bank.discard(microbatch)
    return peak


# ---- negative controls ----------------------------------------------------------

BREAKS = ("prefix_grads", "prefix_attention", "w_order")


def _first_stage_weights_first_segment_first(order: Order) -> Order:
    """Stage 0's W steps of each microbatch moved after its last I step, segment 0 first.

    On the first stage the W step holds the whole backward, so this runs
    segment 0's K/V gradient before later segments have banked theirs.
    """
    reordered = {}
    for rank, actions in order.items():
        weights = defaultdict(list)
        for action in actions:
            if action.stage == 0 and action.kind == "W":
                weights[action.microbatch].append(action)
        kept = []
        for action in actions:
            if action.stage == 0 and action.kind == "W":
                continue
            kept.append(action)
            if action.stage == 0 and action.kind == "I" and action.segment == 0:
                kept += sorted(weights[action.microbatch], key=lambda a: a.segment)
        reordered[rank] = kept
    return reordered


@contextlib.contextmanager
def broken(what: str, case: Case) -> Iterator[None]:
    """Switch off one part of the cross-segment machinery (one of BREAKS).

    - "prefix_grads": dK/dV of the prefix are dropped instead of routed to
      the earlier segments' backward;
    - "prefix_attention": a segment attends to its own tokens only;
    - "w_order": on a split-backward schedule's first stage, W steps run
      first segment first (the order validator, which rejects that, is
      bypassed).
    """
    if what == "prefix_grads":
        patch = mock.patch.object(
            kv_store._PrefixBuffers,
            "take_grads",
            lambda self, start, end, gk, gv: (gk[:, start:end], gv[:, start:end]),
        )
    elif what == "prefix_attention":
        patch = mock.patch.object(kv_store.KVStore, "attach", lambda self, layer, k, v: (k, v))
    elif what == "w_order":
        cls = SCHEDULES[case.schedule]
        build = cls._build_segment_order
        patch = contextlib.ExitStack()
        patch.enter_context(mock.patch.object(schedule_runtime, "validate_order", lambda *a: None))
        patch.enter_context(
            mock.patch.object(
                cls,
                "_build_segment_order",
                lambda self: _first_stage_weights_first_segment_first(build(self)),
            )
        )
    else:
        raise ValueError(f"unknown break {what!r}; choose one of {BREAKS}")
    with patch:
        yield


def pipelined_broken(rank: int, world_size: int, runs: list[tuple[Case, str]]) -> list[dict]:
    """:func:`pipelined` for each (case, break) with that part switched off."""
    results = []
    for case, what in runs:
        with broken(what, case):
            results.append(pipelined(rank, world_size, case))
    return results


def worst_relative_grad_error(ranks: list[dict], ref: dict) -> float:
    """max over parameters of max|g - g_ref| / max|g_ref|."""
    return max(
        ((g - ref["grads"][n]).abs().max() / ref["grads"][n].abs().max()).item()
        for rank in ranks
        for n, g in rank["grads"].items()
    )

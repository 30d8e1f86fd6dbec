# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Multi-process gloo runs for tests, and the unsplit reference they compare to."""

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
    SegmentPlan,
)
from torchtitan_seq1f1b import kv_store, schedule as schedule_module
from torchtitan_seq1f1b._launch import RankFailure, run_ranks  # noqa: F401 - used by tests
from torchtitan_seq1f1b.orders import Order
from tests.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.examples.tiny_transformer import (
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)


SCHEDULES = {
    "Seq1F1B": ScheduleSeq1F1B,
    "InterleavedSeq1F1B": ScheduleInterleavedSeq1F1B,
    "Seq1F1BZeroBubble": ScheduleSeq1F1BZeroBubble,
    "Seq1F1BZBV": ScheduleSeq1F1BZBV,
}


@dataclass(frozen=True)
class Case:
    """One exactness configuration of the tiny transformer."""

    n_microbatches: int
    lengths: tuple[int, ...]
    n_kv_heads: int = 4
    activation_checkpoint: str = "none"  # ACTIVATION_CHECKPOINT_MODES
    microbatch_size: int = 2
    schedule: str = "Seq1F1B"
    stages_per_rank: int = 1
    n_layers: int = 4
    # Every backward on a fresh thread, as CUDA's autograd engine runs it.
    device_thread: bool = True
    dtype: torch.dtype = torch.float64

    @property
    def plan(self) -> SegmentPlan:
        return SegmentPlan.from_lengths(self.lengths)

    @property
    def model_args(self) -> TinyTransformerArgs:
        return TinyTransformerArgs(
            n_layers=self.n_layers,
            n_kv_heads=self.n_kv_heads,
            activation_checkpoint=self.activation_checkpoint,
            attention_backend="sdpa",
        )

    def model(self) -> TinyTransformer:
        torch.manual_seed(0)
        return TinyTransformer(self.model_args).to(self.dtype)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, target: (n_microbatches * microbatch_size, seq_len); some targets ignored."""
        gen = torch.Generator().manual_seed(1)
        shape = (self.n_microbatches * self.microbatch_size, sum(self.lengths))
        tokens = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target[torch.rand(shape, generator=gen) < 0.15] = -100
        return tokens, target


def reference(case: Case, dtype: torch.dtype | None = None) -> dict:
    """Unsplit, non-pipelined loss, gradients and logits in one process.

    ``dtype``: compute in it instead of ``case.dtype``, from the same
    weights (a bf16 case's weights, exactly, in float64).
    ``loss_sums``: the summed token losses of each microbatch (rows
    ``i * microbatch_size`` to ``(i + 1) * microbatch_size``), what the
    schedules report per microbatch.
    """
    model = case.model().to(dtype or case.dtype)
    tokens, target = case.batch()
    logits = model(tokens)
    loss_sum = token_sum_cross_entropy(logits, target)
    (loss_sum / (target != -100).sum()).backward()
    rows = case.microbatch_size
    return {
        "loss_sum": loss_sum.detach(),
        "loss_sums": [
            token_sum_cross_entropy(logits[i : i + rows], target[i : i + rows]).detach()
            for i in range(0, logits.shape[0], rows)
        ],
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "logits": logits.detach(),
    }


def pipelined(
    rank: int, world_size: int, case: Case, loss_normalizer: float | None = None
) -> dict:
    """One training step and one eval() of ``case.schedule`` on this rank's stages.

    Stages ``rank + c * world_size`` for each chunk c (loop placement), or
    ``rank`` and ``2 * world_size - 1 - rank`` for the V of Seq1F1BZBV.
    """
    model = case.model()
    num_stages = world_size * case.stages_per_rank
    if case.schedule == "Seq1F1BZBV":
        indices = [rank, num_stages - 1 - rank]
    else:
        indices = [rank + c * world_size for c in range(case.stages_per_rank)]
    parts = [model.stage(i, num_stages) for i in indices]
    stages = [
        PipelineStage(part, i, num_stages, torch.device("cpu"))
        for part, i in zip(parts, indices)
    ]
    schedule = SCHEDULES[case.schedule](
        stages,
        case.n_microbatches,
        case.plan,
        loss_fn=token_sum_cross_entropy,
        positions_kwarg="positions",
    )
    schedule.loss_normalizer = loss_normalizer
    tokens, target = case.batch()
    inputs = (tokens,) if rank == 0 else ()
    has_last = indices[-1] == num_stages - 1
    losses: list = []
    with backward_on_fresh_thread(case.device_thread):
        schedule.step(*inputs, target=target if has_last else None, losses=losses)
    stores = [schedule.kv_stores[i] for i in indices]
    result = {
        "grads": {n: p.grad.clone() for part in parts for n, p in part.named_parameters()},
        "losses": [loss.clone() for loss in losses],
        "kv_left_after_step": sum(len(store) for store in stores),
        "kv_peak_bytes": {i: store.peak_bytes for i, store in zip(indices, stores)},
        "segment_order": schedule.segment_order,
        # Sequence length of every chunk's activation and gradient receive buffer.
        "recv_lens": [
            [info.buffer.shape[1] for info in infos if info.buffer is not None]
            for stage in stages
            for recv in (stage.args_recv_info, stage.grad_recv_info)
            for infos in (recv[chunk] for chunk in sorted(recv))
        ],
    }
    with torch.no_grad():
        logits = schedule.eval(*inputs, target=target if has_last else None)
    result["logits"] = logits.clone() if has_last else None
    result["kv_left_after_eval"] = sum(len(store) for store in stores)
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
        patch.enter_context(mock.patch.object(schedule_module, "validate_order", lambda *a: None))
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

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipelined runs of the tiny transformer and the unsplit reference they must equal.

The exactness tests and ``python -m torchtitan_seq1f1b.check`` run a
:class:`Case` through a Seq1F1B schedule on several ranks (:func:`pipelined`,
under ``run_ranks``; :func:`context_parallel_pipelined` with context
parallelism inside each pipeline rank) and compare every gradient, loss and
eval logit with :func:`reference`, the same model trained unsplit in one
process. Results come back on the CPU whatever the device.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
    SegmentAwareAttention,
    SegmentPlan,
)
from torchtitan_seq1f1b._torch_compat.introspection import recorded_p2p_receives
from torchtitan_seq1f1b.attention import AttentionBackend, bind_documents
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.context_parallel import ContextGroup, HeadTail
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
    # Every backward on a fresh thread, as CUDA's autograd engine runs it
    # (on CUDA it does so anyway).
    device_thread: bool = True
    device: str = "cpu"
    """"cpu", or "cuda": rank r runs on GPU r, the reference on GPU 0."""
    dtype: torch.dtype = torch.float64
    documents: tuple[tuple[int, ...], ...] | None = None
    """Packed documents: per row, document lengths summing to seq_len (rows
    take the layouts in turn); None is causal attention."""
    compile: bool = False
    """Stages compile every block (``fullgraph=True``); the reference stays eager."""
    window_left: int | None = None
    """Sliding windows in every other layer (:attr:`TinyTransformerArgs.window_left`)."""
    linear_attention_interval: int | None = None
    """GatedDeltaNet in every layer but each interval-th, as qwen3_5
    (:attr:`TinyTransformerArgs.linear_attention_interval`)."""

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
            compile=self.compile,
            window_left=self.window_left,
            linear_attention_interval=self.linear_attention_interval,
        )

    def rank_device(self, rank: int) -> torch.device:
        return torch.device(self.device, rank) if self.device == "cuda" else torch.device("cpu")

    def model(self, device: torch.device | str = "cpu") -> TinyTransformer:
        """``dtype`` weights, the same on every device (initialised on the CPU)."""
        torch.manual_seed(0)
        return TinyTransformer(self.model_args).to(device=device, dtype=self.dtype)

    def batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, target: (n_microbatches * microbatch_size, seq_len); some targets ignored."""
        gen = torch.Generator().manual_seed(1)
        shape = (self.n_microbatches * self.microbatch_size, sum(self.lengths))
        tokens = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target[torch.rand(shape, generator=gen) < 0.15] = -100
        return tokens.to(device), target.to(device)

    def document_ids(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """(n_microbatches * microbatch_size, seq_len) ids of :attr:`documents`, or None."""
        if self.documents is None:
            return None
        rows = self.n_microbatches * self.microbatch_size
        layouts = [self.documents[i % len(self.documents)] for i in range(rows)]
        for lengths in layouts:
            if sum(lengths) != self.plan.seq_len:
                raise ValueError(f"document lengths {lengths} do not sum to {self.plan.seq_len}")
        ids = [[doc for doc, n in enumerate(lengths) for _ in range(n)] for lengths in layouts]
        return torch.tensor(ids, device=device)


class ExplicitDocumentAttention(nn.Module):
    """The reference's attention: SDPA with an explicit (batch, 1, L, L)
    block-causal mask, banded for a sliding window, independent of the
    segment-aware machinery.

    q: (batch, heads, L, head_dim); k, v: (batch, kv_heads, L, head_dim).
    """

    def __init__(self, document_ids: torch.Tensor, window_left: int | None = None):
        super().__init__()
        self.document_ids = document_ids
        self.window_left = window_left

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ids, length = self.document_ids, q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        if self.window_left is not None:
            causal = causal.triu(-self.window_left)
        mask = (ids[:, :, None] == ids[:, None, :]) & causal
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1]
        )


def _host(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy (results cross process boundaries and outlive the step)."""
    return x.detach().to("cpu", copy=True)


def reference(case: Case, dtype: torch.dtype | None = None) -> dict:
    """Unsplit, non-pipelined loss, gradients and logits in one process.

    ``dtype``: compute in it instead of ``case.dtype``, from the same
    weights (a bf16 case's weights, exactly, in float64).
    ``loss_sums``: the summed token losses of each microbatch (rows
    ``i * microbatch_size`` to ``(i + 1) * microbatch_size``), what the
    schedules report per microbatch.
    """
    device = case.rank_device(0)
    model = case.model(device).to(dtype or case.dtype)
    tokens, target = case.batch(device)
    document_ids = case.document_ids(device)
    if document_ids is not None or case.window_left is not None:
        mask_ids = torch.zeros_like(tokens) if document_ids is None else document_ids
        for i, layer in model.layers.items():
            if int(i) not in case.model_args.linear_layers:
                window_left = layer.attention.inner_attention.window_left
                layer.attention.inner_attention = ExplicitDocumentAttention(mask_ids, window_left)
    # GatedDeltaNet restarts at document starts through a one-segment unit, which
    # tests/linear_attention checks against qwen3_5's layer on each document alone.
    bind_documents(model, document_ids)
    logits = model(tokens)
    loss_sum = token_sum_cross_entropy(logits, target)
    (loss_sum / (target != -100).sum()).backward()
    rows = case.microbatch_size
    return {
        "loss_sum": _host(loss_sum),
        "loss_sums": [
            _host(token_sum_cross_entropy(logits[i : i + rows], target[i : i + rows]))
            for i in range(0, logits.shape[0], rows)
        ],
        "grads": {n: _host(p.grad) for n, p in model.named_parameters()},
        "logits": _host(logits),
    }


def build_schedule(
    rank: int,
    world_size: int,
    case: Case,
    attention_backend: AttentionBackend | None = None,
    pp_group=None,
    context_parallel=None,
    device: torch.device | None = None,
    loss_fn=token_sum_cross_entropy,
) -> tuple[ScheduleSeq1F1B, list[TinyTransformer], list[int]]:
    """``case.schedule`` over this rank's stages: (schedule, model parts, stage indices).

    Stages ``rank + c * world_size`` for each chunk c (loop placement), or
    ``rank`` and ``2 * world_size - 1 - rank`` for the V of Seq1F1BZBV. Every
    attention layer runs ``attention_backend`` if given (the exact one otherwise).
    With ``pp_group`` (the default group if None), ``rank`` and ``world_size`` are
    the rank's place in it; ``context_parallel`` is the schedule's CP group; ``device``
    the rank's (``case.rank_device(rank)`` if None); ``loss_fn`` the last stage's.
    """
    device = device or case.rank_device(rank)
    model = case.model(device)
    num_stages = world_size * case.stages_per_rank
    if case.schedule == "Seq1F1BZBV":
        indices = [rank, num_stages - 1 - rank]
    else:
        indices = [rank + c * world_size for c in range(case.stages_per_rank)]
    parts = [model.stage(i, num_stages) for i in indices]
    if attention_backend is not None:
        for part in parts:
            for module in part.modules():
                if isinstance(module, SegmentAwareAttention):
                    module.backend = attention_backend
    stages = [
        PipelineStage(part, i, num_stages, device, group=pp_group)
        for part, i in zip(parts, indices)
    ]
    schedule = SCHEDULES[case.schedule](
        stages,
        case.n_microbatches,
        case.plan,
        loss_fn=loss_fn,
        positions_kwarg="positions",
        document_ids_kwarg="document_ids",
        context_parallel=context_parallel,
    )
    return schedule, parts, indices


def holds_last_stage(case: Case, world_size: int, indices: list[int]) -> bool:
    """Whether a rank holding stages ``indices`` (:func:`build_schedule`) holds the last."""
    return indices[-1] == world_size * case.stages_per_rank - 1


def step_inputs(rank: int, case: Case, has_last: bool) -> tuple[tuple, dict]:
    """What this rank passes to ``step()`` and ``eval()``: (args, kwargs)."""
    device = case.rank_device(rank)
    tokens, target = case.batch(device)
    inputs = (tokens,) if rank == 0 else ()
    # Document ids go to every rank.
    kwargs = {"target": target if has_last else None, "document_ids": case.document_ids(device)}
    return inputs, kwargs


def pipelined(
    rank: int,
    world_size: int,
    case: Case,
    loss_normalizer: float | None = None,
    attention_backend: AttentionBackend | None = None,
) -> dict:
    """One training step and one eval() of ``case.schedule`` on this rank's stages
    (:func:`build_schedule`)."""
    schedule, parts, indices = build_schedule(rank, world_size, case, attention_backend)
    schedule.loss_normalizer = loss_normalizer
    has_last = holds_last_stage(case, world_size, indices)
    inputs, kwargs = step_inputs(rank, case, has_last)
    losses: list = []
    with backward_on_fresh_thread(case.device_thread), recorded_p2p_receives() as received:
        schedule.step(*inputs, losses=losses, **kwargs)
    stores = [schedule.kv_stores[i] for i in indices]
    result = {
        "grads": {n: _host(p.grad) for part in parts for n, p in part.named_parameters()},
        "losses": [_host(loss) for loss in losses],
        "kv_left_after_step": sum(len(store) for store in stores),
        "kv_peak_bytes": {i: store.peak_bytes for i, store in zip(indices, stores)},
        "segment_order": schedule.segment_order,
        # Sequence length of every buffer an activation or gradient was received into.
        "recv_lens": [shape[1] for shape in received],
    }
    with torch.no_grad():
        logits = schedule.eval(*inputs, **kwargs)
    result["logits"] = _host(logits) if has_last else None
    result["kv_left_after_eval"] = sum(len(store) for store in stores)
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]


def context_parallel_groups(rank: int, world_size: int, cp_degree: int):
    """(pp group, pp rank, cp group, cp rank) of ``rank``, PP outermost as torchtitan's
    mesh lays ranks out: rank ``pp_rank * cp_degree + cp_rank``. Every rank creates
    every group (torch requires it)."""
    pp_degree = world_size // cp_degree
    pp_groups = [
        dist.new_group([pp * cp_degree + cp for pp in range(pp_degree)]) for cp in range(cp_degree)
    ]
    cp_groups = [
        dist.new_group([pp * cp_degree + cp for cp in range(cp_degree)]) for pp in range(pp_degree)
    ]
    pp_rank, cp_rank = divmod(rank, cp_degree)
    return pp_groups[cp_rank], pp_rank, cp_groups[pp_rank], cp_rank


def context_parallel_pipelined(rank: int, world_size: int, case: Case, cp_degree: int) -> dict:
    """One training step of ``case.schedule`` with context parallelism of ``cp_degree``
    inside each of ``world_size / cp_degree`` pipeline ranks
    (:func:`context_parallel_groups`); on CUDA rank r runs on GPU r.

    Returns the rank's parameter gradients and its per-microbatch loss sums
    (n_microbatches,), zeros off the last stage, each summed over its CP group (then
    those of the unsplit batch); whether it holds the last stage; its CP rank.
    """
    pp_group, pp_rank, cp_group, cp_rank = context_parallel_groups(rank, world_size, cp_degree)
    device = case.rank_device(rank)
    context = ContextGroup(HeadTail(cp_degree, cp_rank), cp_group)
    pp_degree = world_size // cp_degree
    schedule, parts, indices = build_schedule(
        pp_rank, pp_degree, case, None, pp_group, context, device
    )
    has_last = holds_last_stage(case, pp_degree, indices)
    tokens, target = case.batch(device)
    losses: list = []
    with backward_on_fresh_thread(case.device_thread):
        schedule.step(
            *((tokens,) if pp_rank == 0 else ()), target=target if has_last else None,
            losses=losses, document_ids=case.document_ids(device),
        )
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=cp_group)
    if has_last:
        loss_sums = torch.stack(losses)
    else:
        loss_sums = torch.zeros(case.n_microbatches, dtype=case.dtype, device=device)
    dist.all_reduce(loss_sums, group=cp_group)
    return {
        "grads": {n: _host(grad) for n, grad in grads.items()},
        "losses": _host(loss_sums),
        "last": has_last,
        "cp_rank": cp_rank,
    }


def context_parallel_cases(
    rank: int, world_size: int, cases: list[Case], cp_degree: int
) -> list[dict]:
    return [context_parallel_pipelined(rank, world_size, case, cp_degree) for case in cases]

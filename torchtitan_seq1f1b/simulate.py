# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline timeline and memory simulator for Seq1F1B and torch's schedules.

Run ``python -m torchtitan_seq1f1b.simulate --help``. It replays the exact
per-rank action orders the real schedules execute and reports makespan,
bubble fraction and per-rank peak memory. ``--paper`` compares the memory
model with the Seq1F1B paper's published peak-memory figure.

Schedules (p ranks, v stages per rank, m microbatches, k segments)
    - ``1F1B``, ``Seq1F1B``: ``orders.seq1f1b_order`` (k = 1 is torch's 1F1B).
      ``GPipe``: :func:`gpipe_order` (torch's ScheduleGPipe).
    - ``Interleaved1F1B``, ``InterleavedSeq1F1B`` (v >= 2, stage ``c*p + r``
      on rank r): ``orders.interleaved_seq1f1b_order``. With k = 1 it is
      exactly torch's ScheduleInterleaved1F1B order whenever torch accepts m
      (m a multiple of its rounds, ``max(1, m // p)``); for other m torch
      refuses to run and the simulated order is this repo's generalisation.
    - ``Seq1F1BZeroBubble``: ``orders.seq1f1b_zero_bubble_order``, every
      backward split into an input-gradient (I) and a weight-gradient (W) step.
    - ``LoopedBFS`` (v >= 2, loop placement) and ``ZBVZeroBubble`` (v = 2, V
      placement: rank r holds stages r and 2p-1-r; I/W split): the orders
      torch's own classes compute, through ``_torch_compat.torch_schedule_order``.

Timeline model
    - Unit (i, j) = segment j of microbatch i. Time is measured in "forwards
      of one whole microbatch over one rank's share of the model": unit j's
      forward costs ``TransformerCost.forward_flops(len_j, end_j) /
      forward_flops(S, S)`` on a stage holding ``L/p`` blocks, scaled by the
      stage's share of blocks (``L/(p*v)`` each when p*v divides L), with the
      LM head's FLOPs spread evenly over stages, as in the design note's
      simulations. Backward (B) = 2 x forward.
    - Split backwards (I, W; ``backward_split``): "equal" (default) takes
      I = W = F, the zero-bubble paper's assumption, exact for matmuls.
      "flops" takes W = the unit's weight-gradient FLOPs, which equal its
      forward's matmuls with weights (projections, MLP, LM head), and I =
      B - W: causal attention (QK^T, AV) has no weights, so its whole backward
      sits in I, and late, long-prefix segments get I > W.
    - Each rank runs its actions in order, one at a time. F(s, u) starts after
      F(s-1, u); B or I(s, u) after B or I(s+1, u), and on the last stage
      after its own F(s, u); W(s, u) after I(s, u). A dependency on another
      rank adds the p2p latency. Same-stage unit order (F(i, j-1) before
      F(i, j), B(i, j+1) before B(i, j)) comes from the order itself.
    - bubble fraction = idle / (p * makespan). Next to it: the simulated
      bubble with equal-cost units (F = I = W = 1/(k v), B = 2/(k v)) and,
      where it is exact, its closed form: ``(p-1)/(v*m*k + p-1)`` for the
      1F1B family and LoopedBFS (k = 1 for torch's schedules), ``(p-1)/(3*v*m*k
      + p-1)`` for Seq1F1BZeroBubble and ZBVZeroBubble (conditions at
      ``SCHEDULE_SPECS``).

Memory model (per rank, bytes; bf16 activations, micro-batch size ``b``)
    - A rank's memory is the sum over its stages: model states of every
      stage, and, walking the rank's order, the activations and K/V store of
      every stage's units in flight.
    - Model states: bf16 params (2 B) + fp32 gradient buffer (4 B) + Adam fp32
      master weights, m and v (12 B) per parameter, i.e. Megatron's bf16
      accounting (18 B/param; ``6 + 12/dp`` with its distributed optimizer,
      ``--distributed-optimizer``). Parameters are split by PP (blocks split
      over the p*v stages, earliest stages taking any remainder; the input
      embedding on the first stage, the LM head and final norm on the last)
      and by TP (matrices split, norms and row-parallel biases replicated).
    - Activations per transformer block, Korthikanti et al. 2022 ("Reducing
      activation recomputation in large transformer models"): ``s b h (34 +
      5 a s / h)`` bytes for MHA with a GeLU MLP of width 4h, made of a part
      TP cannot split (norm inputs 4, attention and MLP inputs 2 + 2, dropout
      masks 1 + 1 = 10 sbh) and a part it splits (Q 2, K and V 4, attention
      output 2, MLP hidden 16 = 24 sbh), plus the score term. With sequence
      parallel everything is divided by tp; without, only the second part.
      Generalised here to GQA (K and V cost ``4 g/h`` instead of 4) and SwiGLU
      (four F-wide tensors, ``8 F/h``, instead of two, ``4 F/h``); for the
      paper's GPT shapes this is exactly 34. ``dropout=False`` drops the two
      mask bytes and the score-dropout terms (the paper ran with dropout 0).
    - The score term ``5 a s^2 b`` (softmax output, dropout mask, dropout
      output) exists only for ``--attention eager``. A segment of length s_j
      ending at position P_j materialises a ``s_j x P_j`` score block per head,
      so a unit stores ``5 a s_j P_j b`` (the full rectangle, as the eager
      formula does for s x s). With flash attention (the default; the paper's
      scripts pass ``--use-flash-attn``; torch SDPA on GPU behaves the same)
      no scores are stored and activations are linear in tokens.
    - Last stage also keeps the final-norm and LM-head inputs (4 sbh, split by
      tp under SP) and the fp32 softmax of the vocabulary-parallel loss
      (``4 s b V / tp``).
    - A unit's activations live until its backward ends: its B, or its W for
      split backwards (the weight gradients still read the saved inputs of
      every matmul; the input-gradient step frees nothing in this model).
    - K/V store (k > 1 only) per stage and microbatch in flight:
      ``kv_store="preallocated"`` (this repo's ``KVStore``) allocates K and V
      for the whole sequence at the microbatch's first forward
      (``2 * S * g * d / tp * 2`` bytes per block) and fp32 prefix gradients
      (``2 * offset_{k-1} * g * d / tp * 4``) at its first backward (B or I);
      ``kv_store="prefix"`` (the paper's Megatron code: ``torch.cat`` of the
      prefix per segment) holds bf16 K/V of the prefix forwarded so far and,
      from the first backward, bf16 dK/dV of the whole sequence (a view of
      the first segment backward's dK keeps it alive). Both are freed when
      the microbatch's last backward (B, or W) on that stage finishes. The
      segment's own K/V stays in the 34-term as well (a small double count
      for the preallocated store).
    - Not modelled: transient tensors inside one block's forward/backward,
      p2p buffers, allocator fragmentation, CUDA context, workspaces.
    - The peak on a rank depends only on that rank's order, not on timing.

``--paper`` assumptions (inferred from the authors' launch scripts, ``run.sh``
/ ``exp.sh`` / ``exp2.sh`` of github.com/thunlp/Seq1F1B, and the figures)
    - Megatron-LM, bf16, micro-batch size 1, flash attention, sequence
      parallel, no recomputation, dropout 0, untied embeddings, RoPE,
      ``--use-distributed-optimizer``; data parallel size 1 in every
      configuration (GPUs = tp * pp), so the distributed optimizer shards
      nothing: 18 bytes per parameter.
    - Layouts: 2.7B on 8 GPUs tp=1 pp=8; 7B and 13B on 32 GPUs tp=8 pp=4;
      30B on 64 GPUs tp=8 pp=8 (the scripts' 30B setting). See PAPER_CONFIGS.
      Chosen because they fit the published 1F1B peaks best, not only the
      ratios: for 2.7B, tp=2 pp=4 would predict 26 GB against 51.4 published
      (ratio 0.68 against 0.58), tp=1 pp=8 predicts 47 GB; for 7B/13B, tp=4
      pp=8 would predict 36/58 GB against 28/44 published.
    - Seq1F1B: k = 4 segments ("--pipe-sp-splits 4") with the
      computation-wise ("uniform_comp") partition = ``SegmentPlan.balanced``
      aligned to tp; K/V store = ``prefix``.
    - Interleaved (1F1B-I, Seq1F1B-I): v = 2 model chunks per rank. The
      scripts sweep ``VPP_SIZES=(2 4)``; which one the figure shows is not
      published, 2 is an assumption.
    - Microbatches: 8 (7B, 13B: the paper's throughput runs use 8), 16 (2.7B,
      30B). Peak memory does not depend on m once m >= p.
    - Published numbers are "max reserved" memory; predictions are the
      maximum over ranks of the modelled peak, in GiB (2**30 bytes). They come
      out at 70-90% of the published values (allocator caching/fragmentation
      and per-block transients are not modelled), so compare ratios:
      Seq1F1B / 1F1B is within 0.06 of the published ratio everywhere.
      The interleaved rows are reported, not fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from torchtitan_seq1f1b._torch_compat.introspection import torch_schedule_order
from torchtitan_seq1f1b.actions import Order, SegmentAction
from torchtitan_seq1f1b.orders import (
    equal_cost_bubble,
    gpipe_order,
    interleaved_seq1f1b_order,
    replay,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost
from torchtitan_seq1f1b.tools.model_shapes import (
    embedding_params,
    final_norm_params,
    get_preset,
    layer_params,
    MODEL_PRESETS,
    padded_vocab,
)

__all__ = [
    "number_at_least",
    "positive_int",
    "write_json",
    "PAPER_CONFIGS",
    "MemoryModel",
    "PaperConfig",
    "RankReport",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "ScheduleSpec",
    "SimConfig",
    "SimResult",
    "analytic_bubble",
    "gpipe_order",
    "main",
    "run_paper",
    "schedule_order",
    "simulate",
]

GIB = 2**30


# ---- schedules --------------------------------------------------------------


def _torch_order(schedule_name: str) -> Callable[[int, int, int, int], Order]:
    """Order generator of torch's multi-stage schedule ``schedule_name`` (k = 1)."""

    def order(ranks: int, chunks: int, n_microbatches: int, num_segments: int) -> Order:
        actions = torch_schedule_order(schedule_name, ranks, chunks, n_microbatches)
        return {
            rank: [SegmentAction.from_action(a, num_segments) for a in rank_actions]
            for rank, rank_actions in actions.items()
        }

    return order


def analytic_bubble(
    num_stages: int, n_microbatches: int, num_segments: int = 1, chunks: int = 1
) -> float:
    """Bubble fraction of the 1F1B family with equal-cost units, p = ``num_stages`` ranks.

    ``(p-1) / (v*m*k + p-1)``: 1F1B and GPipe (k = v = 1), Seq1F1B (v = 1),
    interleaved 1F1B (k = 1) and Seq1F1B-I, and LoopedBFS (k = 1).
    """
    return (num_stages - 1) / (chunks * n_microbatches * num_segments + num_stages - 1)


def _zero_bubble_analytic(ranks: int, chunks: int, n_microbatches: int, num_segments: int):
    """``(p-1) / (3*v*m*k + p-1)``: with F = I = W every rank idles (p-1) unit forwards."""
    return (ranks - 1) / (3 * chunks * n_microbatches * num_segments + ranks - 1)


@dataclass(frozen=True)
class ScheduleSpec:
    """What the simulator needs to know about a named schedule.

    Args:
        order: ``order(ranks, chunks, microbatches, segments)`` -> per-rank
            actions: the generator the real schedule runs.
        segmented: cuts microbatches into k segments (otherwise k = 1).
        analytic: ``analytic(ranks, chunks, microbatches, segments)``, the
            bubble fraction with equal-cost units where a closed form is
            exact, else None.
        min_chunks, max_chunks: allowed stages per rank (``max_chunks=None``:
            no upper limit). The default is ``min_chunks``.
    """

    order: Callable[[int, int, int, int], Order]
    segmented: bool
    analytic: Callable[[int, int, int, int], float | None]
    min_chunks: int = 1
    max_chunks: int | None = 1

    @property
    def multi_stage(self) -> bool:
        return self.min_chunks > 1

    def chunks_problem(self, name: str, chunks: int) -> str | None:
        """Why this schedule cannot run ``chunks`` stages per rank, with the fix; else None."""
        if self.min_chunks <= chunks and (self.max_chunks is None or chunks <= self.max_chunks):
            return None
        if self.max_chunks == 1:
            multi = ", ".join(n for n, s in SCHEDULE_SPECS.items() if s.multi_stage)
            return f"{name} runs one stage per rank; use 1, or an interleaved schedule ({multi})"
        if self.max_chunks == self.min_chunks:
            return f"{name} runs exactly {self.min_chunks} stages per rank; use {self.min_chunks}"
        return f"{name} runs several stages (model chunks) per rank; use {self.min_chunks} or more"


# Where the closed forms are exact (checked by tests/test_simulate.py): 1F1B, GPipe
# and Seq1F1B always; interleaved rounds need m*k >= p units (LoopedBFS: m >= p);
# Seq1F1BZeroBubble needs steady state on every rank, m*k >= p + k - 1; torch's ZB-V
# pattern needs m >= 2p - 1.
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "1F1B": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_order(p, m, k), segmented=False,
        analytic=lambda p, v, m, k: analytic_bubble(p, m),
    ),
    "GPipe": ScheduleSpec(
        lambda p, v, m, k: gpipe_order(p, m, k), segmented=False,
        analytic=lambda p, v, m, k: analytic_bubble(p, m),
    ),
    "Seq1F1B": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_order(p, m, k), segmented=True,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k),
    ),
    "Interleaved1F1B": ScheduleSpec(
        interleaved_seq1f1b_order, segmented=False, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m * k >= p else None,
    ),
    "InterleavedSeq1F1B": ScheduleSpec(
        interleaved_seq1f1b_order, segmented=True, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m * k >= p else None,
    ),
    "Seq1F1BZeroBubble": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_zero_bubble_order(p, m, k), segmented=True,
        analytic=lambda p, v, m, k: (
            _zero_bubble_analytic(p, v, m, k) if m * k >= p + k - 1 else None
        ),
    ),
    "Seq1F1BZBV": ScheduleSpec(
        lambda p, v, m, k: seq1f1b_zbv_order(p, m, k), segmented=True,
        min_chunks=2, max_chunks=2, analytic=lambda p, v, m, k: None,
    ),
    "LoopedBFS": ScheduleSpec(
        _torch_order("LoopedBFS"), segmented=False, min_chunks=2, max_chunks=None,
        analytic=lambda p, v, m, k: analytic_bubble(p, m, k, v) if m >= p else None,
    ),
    "ZBVZeroBubble": ScheduleSpec(
        _torch_order("ZBVZeroBubble"), segmented=False, min_chunks=2, max_chunks=2,
        analytic=lambda p, v, m, k: _zero_bubble_analytic(p, v, m, k) if m >= 2 * p - 1 else None,
    ),
}
SCHEDULES = tuple(SCHEDULE_SPECS)
# What the CLI runs without --schedule; "--schedule all" runs every schedule.
DEFAULT_SCHEDULES = ("1F1B", "GPipe", "Seq1F1B")


# ---- configuration ----------------------------------------------------------


@dataclass(frozen=True)
class MemoryModel:
    """Knobs of the memory model (see the module docstring).

    Args:
        sequence_parallel: activations that TP cannot split are sharded along
            the sequence too (Megatron ``--sequence-parallel``).
        attention: "flash" (no score matrix stored) or "eager" (scores,
            softmax and dropout of size ``segment x attended`` per head stored).
        dropout: dropout masks are stored (Korthikanti's 34 assumes so).
        kv_store: "preallocated" (this repo) or "prefix" (the paper's code).
        distributed_optimizer: Adam states and fp32 master weights split by dp.
        micro_batch_size: sequences per microbatch (``b``).
    """

    sequence_parallel: bool = True
    attention: str = "flash"
    dropout: bool = True
    kv_store: str = "preallocated"
    distributed_optimizer: bool = False
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "eager"):
            raise ValueError(f"attention={self.attention!r} must be 'flash' or 'eager'")
        if self.kv_store not in ("preallocated", "prefix"):
            raise ValueError(f"kv_store={self.kv_store!r} must be 'preallocated' or 'prefix'")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1")


@dataclass(frozen=True)
class SimConfig:
    """One simulated training step.

    ``segments`` only applies to the segmented schedules (Seq1F1B,
    InterleavedSeq1F1B, Seq1F1BZeroBubble); torch's schedules run whole
    microbatches (k = 1). ``v`` is the number of stages (model chunks) per
    rank; ``None`` means the schedule's default (1, or 2 for the multi-stage
    schedules). ``backward_split`` sets the I/W costs of split backwards:
    "equal" (I = W = F) or "flops" (W = weight-gradient FLOPs).
    """

    model: TransformerCost
    seq_len: int
    pp: int
    microbatches: int
    segments: int = 4
    schedule: str = "Seq1F1B"
    tp: int = 1
    dp: int = 1
    v: int | None = None
    partition: str = "balanced"
    p2p_latency: float = 0.0
    align: int | None = None
    backward_split: str = "equal"
    memory: MemoryModel = field(default_factory=MemoryModel)
    model_name: str = "custom"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_SPECS:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.v is None:
            object.__setattr__(self, "v", self.spec.min_chunks)
        for name in ("seq_len", "pp", "microbatches", "segments", "tp", "dp", "v"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        problem = self.spec.chunks_problem(self.schedule, self.v)
        if problem:
            raise ValueError(f"v={self.v} stages per rank: {problem}")
        if self.partition not in ("uniform", "balanced"):
            raise ValueError(f"partition={self.partition!r} must be 'uniform' or 'balanced'")
        if self.backward_split not in ("equal", "flops"):
            raise ValueError(
                f"backward_split={self.backward_split!r} must be 'equal' or 'flops'"
            )
        if self.p2p_latency < 0:
            raise ValueError(f"p2p_latency={self.p2p_latency} must be >= 0")
        if self.num_stages > self.model.n_layers:
            raise ValueError(
                f"pp={self.pp} x v={self.v} = {self.num_stages} stages exceeds the model's "
                f"{self.model.n_layers} layers; every stage needs at least one block: "
                "lower pp or v (CLI: --pp, --chunks/-v)"
            )
        if self.model.n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide n_heads={self.model.n_heads}; "
                "tensor parallelism splits attention heads"
            )

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULE_SPECS[self.schedule]

    @property
    def num_stages(self) -> int:
        """Pipeline stages: pp ranks x v stages per rank."""
        return self.pp * self.v

    @property
    def num_segments(self) -> int:
        """k actually used: 1 unless the schedule is segmented."""
        return self.segments if self.spec.segmented else 1

    @property
    def segment_align(self) -> int:
        """Segments are multiples of tp under sequence parallel (each TP rank gets s/tp)."""
        if self.align is not None:
            return self.align
        return self.tp if self.memory.sequence_parallel else 1

    def plan(self) -> SegmentPlan:
        k = self.num_segments
        if self.partition == "uniform" or k == 1:
            return SegmentPlan.uniform(self.seq_len, k, self.segment_align)
        return SegmentPlan.balanced(self.seq_len, k, self.model, self.segment_align)

    def layers_per_stage(self) -> list[int]:
        """Blocks per stage; a remainder goes to the earliest stages."""
        base, extra = divmod(self.model.n_layers, self.num_stages)
        return [base + (1 if s < extra else 0) for s in range(self.num_stages)]


def schedule_order(config: SimConfig) -> Order:
    """The per-rank compute order the real schedule named ``config.schedule`` runs."""
    return config.spec.order(config.pp, config.v, config.microbatches, config.num_segments)


def _weight_grad_flops(cost: TransformerCost, length: int, end: int) -> float:
    """FLOPs of the weight gradients of tokens ``[end - length, end)``.

    A matmul's weight gradient costs as much as its forward, so this is the
    forward minus attention's QK^T and AV, which have no weights. In
    ``forward_flops(s, end) = a s^2 + b s`` only attention depends on how
    many keys a query sees, at ``-2a`` FLOPs per (query, key) pair.
    """
    a, _ = cost.flops_coefficients(end)
    keys_attended = length * end - length * (length - 1) // 2
    return cost.forward_flops(length, end) + 2 * a * keys_attended


def _unit_times(config: SimConfig, plan: SegmentPlan) -> dict[str, list[float]]:
    """Per-segment time of each action kind on a stage holding L/p blocks."""
    cost = config.model
    whole = cost.forward_flops(plan.seq_len, plan.seq_len)
    forward = [f / whole for f in plan.segment_flops(cost)]
    if config.backward_split == "equal":
        weight = forward
    else:
        weight = [
            _weight_grad_flops(cost, n, end) / whole for n, end in zip(plan.lengths, plan.ends)
        ]
    return {
        "F": forward,
        "B": [2 * f for f in forward],
        "I": [2 * f - w for f, w in zip(forward, weight)],
        "W": weight,
    }


# ---- memory -----------------------------------------------------------------


@dataclass(frozen=True)
class _StageMemory:
    """Byte sizes on one stage, derived from a SimConfig."""

    config: SimConfig
    stage: int

    @property
    def _model(self) -> TransformerCost:
        return self.config.model

    @property
    def _layers(self) -> int:
        return self.config.layers_per_stage()[self.stage]

    @property
    def _is_last(self) -> bool:
        return self.stage == self.config.num_stages - 1

    def model_state_bytes(self) -> int:
        cfg, model = self.config, self._model
        params = self._layers * layer_params(model, cfg.tp)
        if self.stage == 0:
            params += embedding_params(model, cfg.tp)
        if self._is_last:
            # Untied: the LM head; tied: the last stage's copy of the embedding.
            params += embedding_params(model, cfg.tp) + final_norm_params(model)
        shards = cfg.dp if cfg.memory.distributed_optimizer else 1
        return params * (2 + 4) + -(-params * 12 // shards)

    def _per_token_bytes(self) -> float:
        """Bytes one token leaves behind in one block, excluding the score term."""
        cfg, model, mem = self.config, self._model, self.config.memory
        h = model.dim
        masks = 2 if mem.dropout else 0
        replicated = (4 + 2 + 2 + masks) * h
        split = (2 + 4 * model.n_kv_heads / model.n_heads + 2) * h
        split += (8 if model.gated_mlp else 4) * model.ffn_hidden_dim
        replicated_div = cfg.tp if mem.sequence_parallel else 1
        return replicated / replicated_div + split / cfg.tp

    def unit_activation_bytes(self, length: int, end: int) -> float:
        """Activations a (microbatch, segment) unit keeps on this stage until its backward."""
        cfg, model, mem = self.config, self._model, self.config.memory
        b = mem.micro_batch_size
        per_layer = self._per_token_bytes() * length * b
        if mem.attention == "eager":
            score_bytes = 5 if mem.dropout else 2
            per_layer += score_bytes * (model.n_heads / cfg.tp) * length * end * b
        total = self._layers * per_layer
        if self._is_last:
            norm_and_head_inputs = 4 * model.dim / (cfg.tp if mem.sequence_parallel else 1)
            loss_softmax = 4 * padded_vocab(model, cfg.tp) / cfg.tp
            total += (norm_and_head_inputs + loss_softmax) * length * b
        return total

    def kv_row_bytes(self, dtype_bytes: int) -> float:
        """K and V of one token over this stage's blocks, on one TP rank."""
        model = self._model
        shards = min(self.config.tp, model.n_kv_heads)
        per_layer = 2 * model.kv_dim / shards * dtype_bytes
        return self._layers * per_layer * self.config.memory.micro_batch_size


@dataclass(frozen=True)
class RankReport:
    """Per-rank results; byte counts are peaks over the step.

    ``peak_activation_microbatches`` is the activation peak in units of one
    unsplit microbatch's activations over all of the rank's stages (the ``A``
    of the design note's theory table).
    """

    rank: int
    stages: tuple[int, ...]
    busy: float
    idle: float
    model_state_bytes: int
    peak_activation_bytes: int
    peak_kv_bytes: int
    peak_memory_bytes: int
    peak_activation_microbatches: float


def _rank_memory(config: SimConfig, plan: SegmentPlan, actions: list[SegmentAction]):
    """Walk one rank's order; return (states, peak activations, peak K/V, peak total, peak mbs).

    State is keyed by stage: a rank holding several stages keeps each stage's
    units and K/V store separately, and its memory is their sum.
    """
    k, mem = plan.num_segments, config.memory
    stages = {s: _StageMemory(config, s) for s in sorted({a.stage for a in actions})}
    act = {
        s: [m.unit_activation_bytes(n, e) for n, e in zip(plan.lengths, plan.ends)]
        for s, m in stages.items()
    }
    # One unsplit microbatch on every stage of the rank: what "activations in microbatches"
    # counts in.
    whole = sum(m.unit_activation_bytes(plan.seq_len, plan.seq_len) for m in stages.values())
    kv_dtype, grad_dtype = (2, 4) if mem.kv_store == "preallocated" else (2, 2)
    kv_row = {s: m.kv_row_bytes(kv_dtype) for s, m in stages.items()}
    grad_row = {s: m.kv_row_bytes(grad_dtype) for s, m in stages.items()}

    live: dict[tuple[int, int, int], float] = {}  # (stage, microbatch, segment)
    kv: dict[tuple[int, int], float] = {}  # (stage, microbatch)
    grads: dict[tuple[int, int], float] = {}
    peaks = {"act": 0.0, "kv": 0.0, "total": 0.0}

    def record() -> None:
        a, s = sum(live.values()), sum(kv.values()) + sum(grads.values())
        peaks["act"] = max(peaks["act"], a)
        peaks["kv"] = max(peaks["kv"], s)
        peaks["total"] = max(peaks["total"], a + s)

    for action in actions:
        s, (i, j) = action.stage, action.unit
        if action.kind == "F":
            live[(s, i, j)] = act[s][j]
            if k > 1:
                held = plan.seq_len if mem.kv_store == "preallocated" else plan.ends[j]
                kv[(s, i)] = held * kv_row[s]
            record()
            continue
        if action.kind in "BI" and k > 1 and j == k - 1:
            # KVStore banks fp32 grads of [0, offset_{k-1}); the paper's code keeps a
            # view of the first backward's dK/dV, which spans the whole sequence.
            rows = plan.offsets[-1] if mem.kv_store == "preallocated" else plan.seq_len
            grads[(s, i)] = rows * grad_row[s]
        record()  # the unit's activations are alive until its backward ends
        if action.kind in "BW":  # its last backward step: B, or W after I
            del live[(s, i, j)]
            if j == 0:
                kv.pop((s, i), None)
                grads.pop((s, i), None)
    states = sum(m.model_state_bytes() for m in stages.values())
    return states, peaks["act"], peaks["kv"], states + peaks["total"], peaks["act"] / whole


# ---- the simulation ---------------------------------------------------------


@dataclass(frozen=True)
class SimResult:
    """Everything one simulation reports.

    ``analytic_bubble_fraction`` is None where no closed form is exact (see
    ``SCHEDULE_SPECS``).
    """

    config: SimConfig
    segment_lengths: tuple[int, ...]
    makespan: float
    bubble_fraction: float
    equal_cost_bubble_fraction: float
    analytic_bubble_fraction: float | None
    ranks: tuple[RankReport, ...]

    @property
    def schedule(self) -> str:
        return self.config.schedule

    @property
    def peak_memory_bytes(self) -> list[int]:
        return [r.peak_memory_bytes for r in self.ranks]

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes)

    def to_record(self) -> dict:
        cfg = self.config
        return {
            "schedule": self.schedule,
            "chunks": cfg.v,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "equal_cost_bubble_fraction": self.equal_cost_bubble_fraction,
            "analytic_bubble_fraction": self.analytic_bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "config": {
                "model": {"name": cfg.model_name, **asdict(cfg.model)},
                "seq_len": cfg.seq_len,
                "pp": cfg.pp,
                "tp": cfg.tp,
                "dp": cfg.dp,
                "v": cfg.v,
                "microbatches": cfg.microbatches,
                "segments": cfg.num_segments,
                "partition": cfg.partition,
                "p2p_latency": cfg.p2p_latency,
                "backward_split": cfg.backward_split,
                "memory": asdict(cfg.memory),
            },
            "segment_lengths": list(self.segment_lengths),
            "ranks": [asdict(r) for r in self.ranks],
        }


def simulate(config: SimConfig) -> SimResult:
    """Simulate one step of ``config.schedule``: timeline and per-rank memory."""
    plan = config.plan()
    k, v = plan.num_segments, config.v
    order = schedule_order(config)
    times = _unit_times(config, plan)
    stage_share = [n * config.pp / config.model.n_layers for n in config.layers_per_stage()]
    timeline = replay(
        order,
        lambda action: times[action.kind][action.segment] * stage_share[action.stage],
        config.p2p_latency,
    )
    ranks = []
    for rank, actions in order.items():
        states, act, kv, total, mbs = _rank_memory(config, plan, actions)
        busy = timeline.busy[rank]
        ranks.append(
            RankReport(
                rank=rank,
                stages=tuple(sorted({a.stage for a in actions})),
                busy=busy,
                idle=timeline.makespan - busy,
                model_state_bytes=int(states),
                peak_activation_bytes=int(act),
                peak_kv_bytes=int(kv),
                peak_memory_bytes=int(total),
                peak_activation_microbatches=mbs,
            )
        )
    return SimResult(
        config=config,
        segment_lengths=plan.lengths,
        makespan=timeline.makespan,
        bubble_fraction=timeline.bubble_fraction,
        equal_cost_bubble_fraction=equal_cost_bubble(order, k, v),
        analytic_bubble_fraction=config.spec.analytic(config.pp, v, config.microbatches, k),
        ranks=tuple(ranks),
    )
# ---- the paper's memory figure ------------------------------------------------


@dataclass(frozen=True)
class PaperConfig:
    """One bar group of the paper's peak-memory figure and the layout inferred for it.

    ``published_gb`` maps a schedule name to the published GB, None for OOM.
    """

    label: str
    model: str
    gpus: int
    seq_len: int
    pp: int
    tp: int
    microbatches: int
    published_gb: dict[str, float | None]

    def sim_config(self, schedule: str) -> SimConfig:
        return SimConfig(
            model=get_preset(self.model),
            model_name=self.model,
            seq_len=self.seq_len,
            pp=self.pp,
            tp=self.tp,
            dp=self.gpus // (self.pp * self.tp),
            microbatches=self.microbatches,
            segments=4,
            schedule=schedule,
            v=PAPER_CHUNKS if SCHEDULE_SPECS[schedule].multi_stage else 1,
            partition="balanced",
            memory=MemoryModel(
                sequence_parallel=True,
                attention="flash",
                dropout=False,
                kv_store="prefix",
                distributed_optimizer=True,
            ),
        )


def _published(one_f_one_b, seq1f1b, interleaved, interleaved_seq1f1b):
    return {
        "1F1B": one_f_one_b,
        "Seq1F1B": seq1f1b,
        "Interleaved1F1B": interleaved,
        "InterleavedSeq1F1B": interleaved_seq1f1b,
    }


# Published peak memory per GPU (GB), 1F1B / Seq1F1B / 1F1B-I / Seq1F1B-I, design
# notes section 5; None = OOM.
PAPER_CONFIGS: tuple[PaperConfig, ...] = (
    PaperConfig("2.7B 8xGPU 16k", "paper-2.7b", 8, 16384, 8, 1, 16,
                _published(51.4, 29.8, 71.0, 29.7)),
    PaperConfig("7B 32xGPU 32k", "paper-7b", 32, 32768, 4, 8, 8,
                _published(28.0, 18.9, 34.2, 16.4)),
    PaperConfig("7B 32xGPU 64k", "paper-7b", 32, 65536, 4, 8, 8,
                _published(51.4, 34.3, 62.9, 28.4)),
    PaperConfig("13B 32xGPU 32k", "paper-13b", 32, 32768, 4, 8, 8,
                _published(44.2, 29.7, 53.2, 25.8)),
    PaperConfig("30B 64xGPU 32k", "paper-30b", 64, 32768, 8, 8, 16,
                _published(71.4, 37.6, None, 38.6)),
)
# Model chunks per rank assumed for the interleaved bars (the scripts sweep 2 and 4).
PAPER_CHUNKS = 2


def run_paper(configs: Sequence[PaperConfig] = PAPER_CONFIGS) -> list[dict]:
    """Predicted vs published peak memory (GiB), with each schedule's ratio to 1F1B.

    Seq1F1B rows carry the Seq1F1B / 1F1B ratios, as do the 1F1B rows. The
    interleaved rows (v = ``PAPER_CHUNKS``) follow, with their own ratio to
    1F1B; a published None (OOM) has no ratio.
    """
    records = []
    for paper in configs:
        predicted = {
            name: simulate(paper.sim_config(name)).max_peak_memory_bytes / GIB
            for name in paper.published_gb
        }

        def ratios(name: str) -> tuple[float, float | None]:
            published = paper.published_gb[name]
            return (
                predicted[name] / predicted["1F1B"],
                None if published is None else published / paper.published_gb["1F1B"],
            )

        for name in paper.published_gb:
            predicted_ratio, published_ratio = ratios("Seq1F1B" if name == "1F1B" else name)
            records.append({
                "config": paper.label,
                "schedule": name,
                "predicted_gb": round(predicted[name], 2),
                "published_gb": paper.published_gb[name],
                "predicted_ratio": round(predicted_ratio, 3),
                "published_ratio": None if published_ratio is None else round(published_ratio, 3),
                "layout": {"gpus": paper.gpus, "pp": paper.pp, "tp": paper.tp,
                           "dp": paper.gpus // (paper.pp * paper.tp),
                           "microbatches": paper.microbatches, "segments": 4,
                           "chunks": paper.sim_config(name).v},
            })
    return records


# ---- command line -------------------------------------------------------------


def number_at_least(
    convert: Callable[[str], float], least: float, expected: str
) -> Callable[[str], float]:
    """An argparse ``type`` converting with ``convert`` and rejecting values below ``least``."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not value >= least:  # also rejects nan
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


positive_int = number_at_least(int, 1, "a positive integer")
_non_negative_float = number_at_least(float, 0, "a number >= 0")


def _schedule_names(text: str) -> list[str]:
    if text.lower() == "all":
        return list(SCHEDULES)
    for name in SCHEDULES:
        if text.lower() == name.lower():
            return [name]
    raise argparse.ArgumentTypeError(
        f"unknown schedule {text!r}; choose from {', '.join(SCHEDULES)} or all"
    )


DEFAULT_SHAPE = {"model": "llama3-8b", "seq_len": 32768, "pp": 4, "microbatches": 8}
"""What runs without options: train_configs/llama3_8b_32k_seq1f1b.toml's shape."""

TABLE_LEGEND = """\
columns:
  v, k        stages per rank, segments per microbatch
  makespan    one step's simulated time, in forwards of one microbatch on one rank
  bubble      idle fraction of all ranks over the makespan, with FLOP-priced units
  equal-cost  the same order's bubble when every unit costs the same (F = 1/(k v),
              B = 2F): the schedule's own bubble, without the segment cost imbalance
  analytic    the closed form of equal-cost where one is exact, e.g. (p-1)/(v m k + p-1)
              for the 1F1B family; '-' where none is
  peak GiB    model states + activations + K/V store held at once, per rank (bf16;
              the memory model options below and the module docstring say what counts)
  (...)       rank 0's peak activations in whole microbatches: p for 1F1B,
              (p + k - 1) / k for uniform Seq1F1B"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.simulate",
        description=(
            "Simulate pipeline timelines (Seq1F1B and its interleaved and zero-bubble "
            "variants, torch's 1F1B, GPipe, Interleaved1F1B, LoopedBFS, ZBVZeroBubble) and "
            "per-rank peak memory from the exact action orders the schedules run. Times are "
            "in forwards of one whole microbatch over one rank's share of the model; "
            "backward = 2 x forward. Without options it simulates "
            f"--model {DEFAULT_SHAPE['model']} --seq-len {DEFAULT_SHAPE['seq_len']} "
            f"--pp {DEFAULT_SHAPE['pp']} -m {DEFAULT_SHAPE['microbatches']} -k 4; the table "
            "ends with a legend of its columns."
        ),
    )
    model = parser.add_argument_group("model (a preset, or explicit dims)")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS),
                       help=f"named model shape (default {DEFAULT_SHAPE['model']} unless "
                            "--layers/--dim/--heads are given)")
    for flag, help_text in (
        ("--layers", "transformer blocks"),
        ("--dim", "model width"),
        ("--heads", "query heads"),
        ("--kv-heads", "K/V heads (default: --heads)"),
        ("--ffn-dim", "MLP hidden width (default: 4 * --dim)"),
        ("--vocab", "vocabulary size (default 128256)"),
    ):
        model.add_argument(flag, type=positive_int, help=help_text)
    model.add_argument("--gated-mlp", action=argparse.BooleanOptionalAction, default=None,
                       help="SwiGLU MLP (explicit dims only; default on)")

    run = parser.add_argument_group("parallelism and schedule")
    run.add_argument("--seq-len", type=positive_int,
                     help=f"tokens per sequence (default {DEFAULT_SHAPE['seq_len']})")
    run.add_argument("--pp", type=positive_int,
                     help=f"pipeline ranks (default {DEFAULT_SHAPE['pp']})")
    run.add_argument("--tp", type=positive_int, default=1, help="tensor parallel degree")
    run.add_argument("--dp", type=positive_int, default=1, help="data parallel degree")
    run.add_argument("--microbatches", "-m", type=positive_int,
                     help=f"microbatches per step (default {DEFAULT_SHAPE['microbatches']})")
    run.add_argument("--segments", "-k", type=positive_int, default=4,
                     help="segments per microbatch of the Seq1F1B schedules (torch's use 1)")
    run.add_argument("--chunks", "-v", "--v", type=positive_int, default=None,
                     help="stages (model chunks) per rank of the multi-stage schedules "
                          "(default 2); the others run 1")
    run.add_argument("--partition", choices=("uniform", "balanced"), default="balanced",
                     help="segment lengths: equal, or equal forward FLOPs")
    run.add_argument("--align", type=positive_int, default=None,
                     help="segment length multiple (default: tp with sequence parallel, else 1)")
    run.add_argument("--schedule", type=_schedule_names, nargs="+",
                     default=[list(DEFAULT_SCHEDULES)], metavar="NAME",
                     help=f"one or more of {', '.join(SCHEDULES)}, or all "
                          f"(default: {' '.join(DEFAULT_SCHEDULES)})")
    run.add_argument("--backward-split", choices=("equal", "flops"), default="equal",
                     help="I/W cost of split backwards: I = W = forward, or W = "
                          "weight-gradient FLOPs and I the rest (attention)")
    run.add_argument("--p2p-latency", type=_non_negative_float, default=0.0,
                     help="added to every cross-rank dependency, in microbatch-forward units")

    mem = parser.add_argument_group("memory model")
    mem.add_argument("--micro-batch-size", type=positive_int, default=1)
    mem.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    mem.add_argument("--attention", choices=("flash", "eager"), default="flash",
                     help="eager stores score matrices (the 5as/h term); flash does not")
    mem.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True,
                     help="store dropout masks (Korthikanti's 34 includes them)")
    mem.add_argument("--kv-store", choices=("preallocated", "prefix"), default="preallocated",
                     help="this repo's whole-sequence K/V buffers, or the paper's growing prefix")
    mem.add_argument("--distributed-optimizer", action="store_true",
                     help="shard fp32 master weights and Adam states over dp")

    out = parser.add_argument_group("output")
    out.add_argument("--paper", action="store_true",
                     help="reproduce the paper's peak-memory figure (ignores the options above)")
    out.add_argument("--json", metavar="PATH", help="also write the results as a JSON list")
    return parser


def _model_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[str, TransformerCost]:
    dims = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads}
    extras = (args.kv_heads, args.ffn_dim, args.vocab, args.gated_mlp)
    explicit = any(v is not None for v in (*dims.values(), *extras))
    if args.model is not None or not explicit:
        if explicit:
            parser.error(
                "give either --model or explicit dims (--layers/--dim/--heads...), not both"
            )
        name = args.model or DEFAULT_SHAPE["model"]
        return name, get_preset(name)
    missing = [flag for flag, value in dims.items() if value is None]
    if missing:
        parser.error(
            f"explicit dims need all of --layers, --dim, --heads (missing "
            f"{', '.join(missing)}), or use --model (one of {', '.join(sorted(MODEL_PRESETS))})"
        )
    try:
        return "custom", TransformerCost(
            n_layers=args.layers,
            dim=args.dim,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads or args.heads,
            ffn_hidden_dim=args.ffn_dim or 4 * args.dim,
            vocab_size=args.vocab or 128256,
            gated_mlp=True if args.gated_mlp is None else args.gated_mlp,
        )
    except ValueError as error:
        parser.error(str(error))


def _chunks_per_schedule(
    parser: argparse.ArgumentParser, names: list[str], chunks: int | None
) -> dict[str, int | None]:
    """--chunks applies to the multi-stage schedules; the others run one stage per rank."""
    multi = [name for name in names if SCHEDULE_SPECS[name].multi_stage]
    if chunks is not None and chunks > 1 and not multi:
        every_multi = [name for name, spec in SCHEDULE_SPECS.items() if spec.multi_stage]
        parser.error(
            f"--chunks/-v {chunks}: the selected schedules ({', '.join(names)}) run one "
            "stage per rank; drop --chunks, or pick an interleaved schedule with "
            f"--schedule ({', '.join(every_multi)})"
        )
    for name in multi:
        problem = chunks is not None and SCHEDULE_SPECS[name].chunks_problem(name, chunks)
        if problem:
            parser.error(f"--chunks/-v {chunks}: {problem}")
    return {name: chunks if name in multi else None for name in names}


def _configs_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[SimConfig]:
    model_name, model = _model_from_args(parser, args)
    for option in ("seq_len", "pp", "microbatches"):
        if getattr(args, option) is None:
            setattr(args, option, DEFAULT_SHAPE[option])
    memory = MemoryModel(
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
        dropout=args.dropout,
        kv_store=args.kv_store,
        distributed_optimizer=args.distributed_optimizer,
        micro_batch_size=args.micro_batch_size,
    )
    base = dict(
        model=model, model_name=model_name, seq_len=args.seq_len, pp=args.pp, tp=args.tp,
        dp=args.dp, microbatches=args.microbatches, segments=args.segments,
        partition=args.partition, p2p_latency=args.p2p_latency, align=args.align,
        backward_split=args.backward_split, memory=memory,
    )
    # De-duplicate, keep order.
    names = list(dict.fromkeys(name for group in args.schedule for name in group))
    configs = []
    for name, chunks in _chunks_per_schedule(parser, names, args.chunks).items():
        try:
            config = SimConfig(schedule=name, v=chunks, **base)
            config.plan()  # segment-length errors surface here, as usage errors
            configs.append(config)
        except ValueError as error:
            parser.error(str(error))
    return configs


def _print_results(results: list[SimResult]) -> None:
    cfg = results[0].config
    print(
        f"model={cfg.model_name} seq_len={cfg.seq_len} pp={cfg.pp} tp={cfg.tp} dp={cfg.dp} "
        f"m={cfg.microbatches} partition={cfg.partition} p2p_latency={cfg.p2p_latency} "
        f"backward_split={cfg.backward_split}"
    )
    width = max(len("schedule"), *(len(r.schedule) for r in results))
    print(f"{'schedule':<{width}} {'v':>2} {'k':>2} {'makespan':>9} {'bubble':>7} "
          f"{'equal-cost':>10} {'analytic':>8}  peak GiB per rank "
          "(rank 0 activations in microbatches)")
    for r in results:
        peaks = " ".join(f"{b / GIB:6.2f}" for b in r.peak_memory_bytes)
        analytic = r.analytic_bubble_fraction
        analytic = "-" if analytic is None else f"{analytic:.4f}"
        print(
            f"{r.schedule:<{width}} {r.config.v:>2} {r.config.num_segments:>2} "
            f"{r.makespan:>9.3f} {r.bubble_fraction:>7.4f} "
            f"{r.equal_cost_bubble_fraction:>10.4f} {analytic:>8}  {peaks}  "
            f"({r.ranks[0].peak_activation_microbatches:.3f})"
        )
        if r.config.num_segments > 1:
            print(f"{'':<{width}} segment lengths {list(r.segment_lengths)}")
    print(TABLE_LEGEND)


def _print_paper(records: list[dict]) -> None:
    print(f"{'config':<16} {'1F1B pred/pub GB':>17} {'Seq1F1B pred/pub GB':>20} "
          f"{'ratio pred/pub':>15} {'diff':>6}")
    by_config: dict[str, dict[str, dict]] = {}
    for rec in records:
        by_config.setdefault(rec["config"], {})[rec["schedule"]] = rec
    for label, recs in by_config.items():
        a, b = recs["1F1B"], recs["Seq1F1B"]
        diff = b["predicted_ratio"] - b["published_ratio"]
        print(
            f"{label:<16} {a['predicted_gb']:>8.1f}/{a['published_gb']:<8.1f} "
            f"{b['predicted_gb']:>10.1f}/{b['published_gb']:<9.1f} "
            f"{b['predicted_ratio']:>7.3f}/{b['published_ratio']:<7.3f} {diff:>+6.3f}"
        )
    print(f"\ninterleaved, v={PAPER_CHUNKS} (reported, not fitted); ratios are to 1F1B")
    print(f"{'config':<16} {'1F1B-I pred/pub GB':>19} {'ratio pred/pub':>15} "
          f"{'Seq1F1B-I pred/pub GB':>22} {'ratio pred/pub':>15}")
    for label, recs in by_config.items():
        cells = []
        for rec in (recs["Interleaved1F1B"], recs["InterleavedSeq1F1B"]):
            published = rec["published_gb"]
            published_ratio = rec["published_ratio"]
            cells.append(
                f"{rec['predicted_gb']:.1f}/{'OOM' if published is None else f'{published:.1f}'}"
            )
            cells.append(
                f"{rec['predicted_ratio']:.3f}/"
                f"{'-' if published_ratio is None else f'{published_ratio:.3f}'}"
            )
        print(f"{label:<16} {cells[0]:>19} {cells[1]:>15} {cells[2]:>22} {cells[3]:>15}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.paper:
        records = run_paper()
        _print_paper(records)
    else:
        results = [simulate(config) for config in _configs_from_args(parser, args)]
        _print_results(results)
        records = [r.to_record() for r in results]
    if args.json:
        write_json(parser, args.json, records)
    return 0


def write_json(parser: argparse.ArgumentParser, path: str, records: list[dict]) -> None:
    """Write a command's ``--json`` records; an unwritable path exits like a bad option."""
    try:
        with open(path, "w") as handle:
            json.dump(records, handle, indent=1)
    except OSError as error:
        parser.exit(1, f"{parser.prog}: error: cannot write --json {path}: {error}\n")


if __name__ == "__main__":
    sys.exit(main())

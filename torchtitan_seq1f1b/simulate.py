# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline timeline and memory simulator for 1F1B, GPipe and Seq1F1B.

Run ``python -m torchtitan_seq1f1b.simulate --help``. It replays the exact
per-rank action orders the real schedules execute (``orders.seq1f1b_order``;
``k = 1`` is torch's 1F1B) and reports makespan, bubble fraction and per-rank
peak memory. ``--paper`` compares the memory model with the Seq1F1B paper's
published peak-memory figure.

Timeline model
    - One pipeline stage per rank (``v = 1``). Interleaved orders (``v > 1``)
      raise ``NotImplementedError``: ``orders.py`` has no interleaved generator.
    - Unit (i, j) = segment j of microbatch i. Its forward time on every stage
      is ``TransformerCost.forward_flops(len_j, end_j) / forward_flops(S, S)``,
      i.e. time is measured in "forwards of one whole microbatch on one stage".
      A stage's share is its fraction of the blocks (1/p when p divides L),
      with the LM head's FLOPs spread evenly over stages, as in the design
      note's simulations.
      Backward = 2 x forward.
    - Each rank runs its actions in order, one at a time. F(s, u) starts after
      F(s-1, u) has finished plus the p2p latency; B(s, u) after B(s+1, u)
      plus latency. Same-stage dependencies (F(i, j-1) before F(i, j), B after
      F, B(i, j+1) before B(i, j)) are guaranteed by the order itself.
    - bubble fraction = idle / (p * makespan). Next to it: the analytic bubble
      ``(p-1)/(m*k+p-1)`` (``k = 1`` for 1F1B and GPipe) and the simulated
      bubble with equal-cost units (F = 1/k, B = 2/k), which must equal it.

Memory model (per rank, bytes; bf16 activations, micro-batch size ``b``)
    - Model states: bf16 params (2 B) + fp32 gradient buffer (4 B) + Adam fp32
      master weights, m and v (12 B) per parameter, i.e. Megatron's bf16
      accounting (18 B/param; ``6 + 12/dp`` with its distributed optimizer,
      ``--distributed-optimizer``). Parameters are split by PP (L/p blocks per
      stage; the input embedding on the first stage, the LM head and final norm
      on the last) and by TP (matrices split, norms and row-parallel biases
      replicated).
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
    - K/V store (k > 1 only) per stage and microbatch in flight:
      ``kv_store="preallocated"`` (this repo's ``KVStore``) allocates K and V
      for the whole sequence at the microbatch's first forward
      (``2 * S * g * d / tp * 2`` bytes per block) and fp32 prefix gradients
      (``2 * offset_{k-1} * g * d / tp * 4``) at its first backward;
      ``kv_store="prefix"`` (the paper's Megatron code: ``torch.cat`` of the
      prefix per segment) holds bf16 K/V of the prefix forwarded so far and,
      from the first backward, bf16 dK/dV of the whole sequence (a view of
      the first segment backward's dK keeps it alive). Both are freed when
      the microbatch's last backward finishes. The segment's own K/V stays in the 34-term as well
      (a small double count for the preallocated store).
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
    - Microbatches: 8 (7B, 13B: the paper's throughput runs use 8), 16 (2.7B,
      30B). Peak memory does not depend on m once m >= p.
    - Published numbers are "max reserved" memory; predictions are the
      maximum over ranks of the modelled peak, in GiB (2**30 bytes). They come
      out at 70-90% of the published values (allocator caching/fragmentation
      and per-block transients are not modelled), so compare ratios:
      Seq1F1B / 1F1B is within 0.06 of the published ratio everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from torchtitan_seq1f1b.actions import SegmentAction
from torchtitan_seq1f1b.model_presets import MODEL_PRESETS, ModelShape, get_preset
from torchtitan_seq1f1b.orders import seq1f1b_order
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = [
    "PAPER_CONFIGS",
    "MemoryModel",
    "PaperConfig",
    "RankReport",
    "SCHEDULES",
    "SimConfig",
    "SimResult",
    "analytic_bubble",
    "gpipe_order",
    "main",
    "run_paper",
    "simulate",
    "simulate_timeline",
]

GIB = 2**30
SCHEDULES = ("1F1B", "GPipe", "Seq1F1B")
Order = dict[int, list[SegmentAction]]


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

    ``segments`` only applies to Seq1F1B; 1F1B and GPipe run whole microbatches
    (k = 1), as torch's schedules of those names do.
    """

    model: ModelShape
    seq_len: int
    pp: int
    microbatches: int
    segments: int = 4
    schedule: str = "Seq1F1B"
    tp: int = 1
    dp: int = 1
    v: int = 1
    partition: str = "balanced"
    p2p_latency: float = 0.0
    align: int | None = None
    memory: MemoryModel = field(default_factory=MemoryModel)

    def __post_init__(self) -> None:
        for name in ("seq_len", "pp", "microbatches", "segments", "tp", "dp", "v"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.partition not in ("uniform", "balanced"):
            raise ValueError(f"partition={self.partition!r} must be 'uniform' or 'balanced'")
        if self.p2p_latency < 0:
            raise ValueError(f"p2p_latency={self.p2p_latency} must be >= 0")
        if self.pp > self.model.n_layers:
            raise ValueError(
                f"pp={self.pp} exceeds the model's {self.model.n_layers} layers; "
                "every stage needs at least one block"
            )
        if self.model.n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide n_heads={self.model.n_heads}; "
                "tensor parallelism splits attention heads"
            )
        if self.v != 1:
            raise NotImplementedError(
                f"v={self.v}: interleaved (virtual-stage) orders are not implemented; "
                "orders.py has no interleaved Seq1F1B generator yet, use v=1"
            )

    @property
    def num_segments(self) -> int:
        """k actually used: 1 unless the schedule is Seq1F1B."""
        return self.segments if self.schedule == "Seq1F1B" else 1

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
        return SegmentPlan.balanced(self.seq_len, k, self.model.cost(), self.segment_align)

    def layers_per_stage(self) -> list[int]:
        """Blocks per stage; a remainder goes to the earliest stages."""
        base, extra = divmod(self.model.n_layers, self.pp)
        return [base + (1 if s < extra else 0) for s in range(self.pp)]


# ---- orders ---------------------------------------------------------------


def gpipe_order(num_stages: int, n_microbatches: int, num_segments: int = 1) -> Order:
    """GPipe: every forward in unit order, then every backward.

    Backwards are FIFO over microbatches and LIFO over segments, the order the
    segment checker requires (torch's ScheduleGPipe for ``num_segments = 1``).
    """
    units = [(i, j) for i in range(n_microbatches) for j in range(num_segments)]
    backward = [(i, j) for i in range(n_microbatches) for j in reversed(range(num_segments))]
    return {
        rank: [SegmentAction(rank, "F", *u) for u in units]
        + [SegmentAction(rank, "B", *u) for u in backward]
        for rank in range(num_stages)
    }


def schedule_order(config: SimConfig) -> Order:
    """The per-rank compute order the real schedule named ``config.schedule`` runs."""
    k = config.num_segments
    if config.schedule == "GPipe":
        return gpipe_order(config.pp, config.microbatches, k)
    return seq1f1b_order(config.pp, config.microbatches, k)


def analytic_bubble(num_stages: int, n_microbatches: int, num_segments: int = 1) -> float:
    """Bubble fraction of 1F1B/GPipe (k = 1) and Seq1F1B with equal-cost units."""
    return (num_stages - 1) / (n_microbatches * num_segments + num_stages - 1)


# ---- timeline ---------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """Start/end time of every action, and each rank's busy time."""

    makespan: float
    busy: dict[int, float]
    spans: dict[SegmentAction, tuple[float, float]]

    @property
    def bubble_fraction(self) -> float:
        ranks = len(self.busy)
        if self.makespan == 0:
            return 0.0
        return 1 - sum(self.busy.values()) / (ranks * self.makespan)


def simulate_timeline(
    order: Order,
    duration: Callable[[SegmentAction], float],
    p2p_latency: float = 0.0,
) -> Timeline:
    """Replay ``order`` with data dependencies across stages (one stage per rank).

    An action's start time depends only on its rank's previous action and on
    its cross-stage dependency, so filling the ranks in any order that respects
    those dependencies gives the same timeline.
    """
    num_stages = len(order)
    position = {rank: 0 for rank in order}
    free_at = {rank: 0.0 for rank in order}
    busy = {rank: 0.0 for rank in order}
    spans: dict[SegmentAction, tuple[float, float]] = {}

    def dependency(action: SegmentAction) -> SegmentAction | None:
        if action.kind == "F" and action.stage > 0:
            return SegmentAction(action.stage - 1, "F", *action.unit)
        if action.kind == "B" and action.stage < num_stages - 1:
            return SegmentAction(action.stage + 1, "B", *action.unit)
        return None

    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if action.kind not in "FB":
                    raise ValueError(f"{action}: only F and B actions are simulated")
                dep = dependency(action)
                if dep is not None and dep not in spans:
                    break
                ready = spans[dep][1] + p2p_latency if dep is not None else 0.0
                start = max(free_at[rank], ready)
                end = start + duration(action)
                spans[action] = (start, end)
                free_at[rank] = end
                busy[rank] += end - start
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [str(order[r][position[r]]) for r in order if position[r] < len(order[r])]
            raise ValueError(f"order deadlocks; next actions {waiting}")
    return Timeline(max(free_at.values(), default=0.0), busy, spans)


# ---- memory -----------------------------------------------------------------


@dataclass(frozen=True)
class _StageMemory:
    """Byte sizes on one stage, derived from a SimConfig."""

    config: SimConfig
    stage: int

    @property
    def _model(self) -> ModelShape:
        return self.config.model

    @property
    def _layers(self) -> int:
        return self.config.layers_per_stage()[self.stage]

    @property
    def _is_last(self) -> bool:
        return self.stage == self.config.pp - 1

    def model_state_bytes(self) -> int:
        cfg, model = self.config, self._model
        params = self._layers * model.layer_params(cfg.tp)
        if self.stage == 0:
            params += model.embedding_params(cfg.tp)
        if self._is_last:
            # Untied: the LM head; tied: the last stage's copy of the embedding.
            params += model.embedding_params(cfg.tp) + model.final_norm_params()
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
            loss_softmax = 4 * model.padded_vocab(cfg.tp) / cfg.tp
            total += (norm_and_head_inputs + loss_softmax) * length * b
        return total

    def _kv_row_bytes(self, dtype_bytes: int) -> float:
        """K and V of one token over this stage's blocks, on one TP rank."""
        model = self._model
        shards = min(self.config.tp, model.n_kv_heads)
        per_layer = 2 * model.kv_dim / shards * dtype_bytes
        return self._layers * per_layer * self.config.memory.micro_batch_size


@dataclass(frozen=True)
class RankReport:
    """Per-rank results; byte counts are peaks over the step."""

    rank: int
    busy: float
    idle: float
    model_state_bytes: int
    peak_activation_bytes: int
    peak_kv_bytes: int
    peak_memory_bytes: int
    peak_activation_microbatches: float


def _rank_memory(config: SimConfig, plan: SegmentPlan, rank: int, actions: list[SegmentAction]):
    """Walk one rank's order; return (states, peak activations, peak K/V, peak total, peak mbs)."""
    stage = _StageMemory(config, rank)
    k, mem = plan.num_segments, config.memory
    act = [stage.unit_activation_bytes(n, e) for n, e in zip(plan.lengths, plan.ends)]
    # One unsplit microbatch: the unit the "activations in microbatches" metric counts in.
    whole = stage.unit_activation_bytes(plan.seq_len, plan.seq_len)
    kv_dtype, grad_dtype = (2, 4) if mem.kv_store == "preallocated" else (2, 2)
    kv_row, grad_row = stage._kv_row_bytes(kv_dtype), stage._kv_row_bytes(grad_dtype)

    live: dict[tuple[int, int], float] = {}
    kv: dict[int, float] = {}
    grads: dict[int, float] = {}
    peaks = {"act": 0.0, "kv": 0.0, "total": 0.0}

    def record() -> None:
        a, s = sum(live.values()), sum(kv.values()) + sum(grads.values())
        peaks["act"] = max(peaks["act"], a)
        peaks["kv"] = max(peaks["kv"], s)
        peaks["total"] = max(peaks["total"], a + s)

    for action in actions:
        i, j = action.unit
        if action.kind == "F":
            live[(i, j)] = act[j]
            if k > 1:
                held = plan.seq_len if mem.kv_store == "preallocated" else plan.ends[j]
                kv[i] = held * kv_row
            record()
        else:
            if k > 1 and j == k - 1:
                # KVStore banks fp32 grads of [0, offset_{k-1}); the paper's code keeps a
                # view of the first backward's dK/dV, which spans the whole sequence.
                rows = plan.offsets[-1] if mem.kv_store == "preallocated" else plan.seq_len
                grads[i] = rows * grad_row
            record()  # the unit's activations are alive until its backward ends
            del live[(i, j)]
            if j == 0:
                kv.pop(i, None)
                grads.pop(i, None)
    states = stage.model_state_bytes()
    return states, peaks["act"], peaks["kv"], states + peaks["total"], peaks["act"] / whole


# ---- the simulation ---------------------------------------------------------


@dataclass(frozen=True)
class SimResult:
    """Everything one simulation reports."""

    config: SimConfig
    segment_lengths: tuple[int, ...]
    makespan: float
    bubble_fraction: float
    equal_cost_bubble_fraction: float
    analytic_bubble_fraction: float
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
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "equal_cost_bubble_fraction": self.equal_cost_bubble_fraction,
            "analytic_bubble_fraction": self.analytic_bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "config": {
                "model": asdict(cfg.model),
                "seq_len": cfg.seq_len,
                "pp": cfg.pp,
                "tp": cfg.tp,
                "dp": cfg.dp,
                "v": cfg.v,
                "microbatches": cfg.microbatches,
                "segments": cfg.num_segments,
                "partition": cfg.partition,
                "p2p_latency": cfg.p2p_latency,
                "memory": asdict(cfg.memory),
            },
            "segment_lengths": list(self.segment_lengths),
            "ranks": [asdict(r) for r in self.ranks],
        }


def simulate(config: SimConfig) -> SimResult:
    """Simulate one step of ``config.schedule``: timeline and per-rank memory."""
    plan = config.plan()
    k = plan.num_segments
    order = schedule_order(config)
    cost = config.model.cost()
    whole = cost.forward_flops(plan.seq_len, plan.seq_len)
    forward = [f / whole for f in plan.segment_flops(cost)]
    stage_share = [n * config.pp / config.model.n_layers for n in config.layers_per_stage()]

    def duration(action: SegmentAction) -> float:
        t = forward[action.segment] * stage_share[action.stage]
        return t if action.kind == "F" else 2 * t

    timeline = simulate_timeline(order, duration, config.p2p_latency)
    equal = simulate_timeline(order, lambda a: (1 if a.kind == "F" else 2) / k, 0.0)
    ranks = []
    for rank, actions in order.items():
        states, act, kv, total, mbs = _rank_memory(config, plan, rank, actions)
        busy = timeline.busy[rank]
        ranks.append(
            RankReport(
                rank=rank,
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
        equal_cost_bubble_fraction=equal.bubble_fraction,
        analytic_bubble_fraction=analytic_bubble(config.pp, config.microbatches, k),
        ranks=tuple(ranks),
    )


# ---- the paper's memory figure ------------------------------------------------


@dataclass(frozen=True)
class PaperConfig:
    """One bar group of the paper's peak-memory figure and the layout inferred for it."""

    label: str
    model: str
    gpus: int
    seq_len: int
    pp: int
    tp: int
    microbatches: int
    published_gb: dict[str, float]

    def sim_config(self, schedule: str) -> SimConfig:
        return SimConfig(
            model=get_preset(self.model),
            seq_len=self.seq_len,
            pp=self.pp,
            tp=self.tp,
            dp=self.gpus // (self.pp * self.tp),
            microbatches=self.microbatches,
            segments=4,
            schedule=schedule,
            partition="balanced",
            memory=MemoryModel(
                sequence_parallel=True,
                attention="flash",
                dropout=False,
                kv_store="prefix",
                distributed_optimizer=True,
            ),
        )


# Published: 1F1B and Seq1F1B peak memory per GPU (GB), design notes section 5.
PAPER_CONFIGS: tuple[PaperConfig, ...] = (
    PaperConfig("2.7B 8xGPU 16k", "paper-2.7b", 8, 16384, 8, 1, 16,
                {"1F1B": 51.4, "Seq1F1B": 29.8}),
    PaperConfig("7B 32xGPU 32k", "paper-7b", 32, 32768, 4, 8, 8,
                {"1F1B": 28.0, "Seq1F1B": 18.9}),
    PaperConfig("7B 32xGPU 64k", "paper-7b", 32, 65536, 4, 8, 8,
                {"1F1B": 51.4, "Seq1F1B": 34.3}),
    PaperConfig("13B 32xGPU 32k", "paper-13b", 32, 32768, 4, 8, 8,
                {"1F1B": 44.2, "Seq1F1B": 29.7}),
    PaperConfig("30B 64xGPU 32k", "paper-30b", 64, 32768, 8, 8, 16,
                {"1F1B": 71.4, "Seq1F1B": 37.6}),
)


def run_paper(configs: Sequence[PaperConfig] = PAPER_CONFIGS) -> list[dict]:
    """Predicted vs published peak memory (GiB) for 1F1B and Seq1F1B, with ratios."""
    records = []
    for paper in configs:
        predicted = {
            name: simulate(paper.sim_config(name)).max_peak_memory_bytes / GIB
            for name in ("1F1B", "Seq1F1B")
        }
        predicted_ratio = predicted["Seq1F1B"] / predicted["1F1B"]
        published_ratio = paper.published_gb["Seq1F1B"] / paper.published_gb["1F1B"]
        for name in ("1F1B", "Seq1F1B"):
            records.append({
                "config": paper.label,
                "schedule": name,
                "predicted_gb": round(predicted[name], 2),
                "published_gb": paper.published_gb[name],
                "predicted_ratio": round(predicted_ratio, 3),
                "published_ratio": round(published_ratio, 3),
                "layout": {"gpus": paper.gpus, "pp": paper.pp, "tp": paper.tp,
                           "dp": paper.gpus // (paper.pp * paper.tp),
                           "microbatches": paper.microbatches, "segments": 4},
            })
    return records


# ---- command line -------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _schedule_name(text: str) -> str:
    for name in SCHEDULES:
        if text.lower() == name.lower():
            return name
    raise argparse.ArgumentTypeError(
        f"unknown schedule {text!r}; choose from {', '.join(SCHEDULES)}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.simulate",
        description=(
            "Simulate 1F1B / GPipe / Seq1F1B pipeline timelines and per-rank peak memory "
            "from the exact action orders the schedules run. Times are in forwards of one "
            "whole microbatch on one stage; backward = 2 x forward."
        ),
    )
    model = parser.add_argument_group("model (a preset, or explicit dims)")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), help="named model shape")
    for flag, help_text in (
        ("--layers", "transformer blocks"),
        ("--dim", "model width"),
        ("--heads", "query heads"),
        ("--kv-heads", "K/V heads (default: --heads)"),
        ("--ffn-dim", "MLP hidden width (default: 4 * --dim)"),
        ("--vocab", "vocabulary size (default 128256)"),
    ):
        model.add_argument(flag, type=_positive_int, help=help_text)
    model.add_argument("--gated-mlp", action=argparse.BooleanOptionalAction, default=None,
                       help="SwiGLU MLP (explicit dims only; default on)")

    run = parser.add_argument_group("parallelism and schedule")
    run.add_argument("--seq-len", type=_positive_int, help="tokens per sequence")
    run.add_argument("--pp", type=_positive_int, help="pipeline stages (= ranks)")
    run.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel degree")
    run.add_argument("--dp", type=_positive_int, default=1, help="data parallel degree")
    run.add_argument("--microbatches", "-m", type=_positive_int, help="microbatches per step")
    run.add_argument("--segments", "-k", type=_positive_int, default=4,
                     help="Seq1F1B segments per microbatch (1F1B and GPipe use 1)")
    run.add_argument("--v", type=_positive_int, default=1,
                     help="stages per rank; only 1 is implemented")
    run.add_argument("--partition", choices=("uniform", "balanced"), default="balanced",
                     help="segment lengths: equal, or equal forward FLOPs")
    run.add_argument("--align", type=_positive_int, default=None,
                     help="segment length multiple (default: tp with sequence parallel, else 1)")
    run.add_argument("--schedule", type=_schedule_name, nargs="+", default=list(SCHEDULES),
                     metavar="NAME", help=f"one or more of {', '.join(SCHEDULES)} (default: all)")
    run.add_argument("--p2p-latency", type=_non_negative_float, default=0.0,
                     help="added to every cross-stage dependency, in microbatch-forward units")

    mem = parser.add_argument_group("memory model")
    mem.add_argument("--micro-batch-size", type=_positive_int, default=1)
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


def _model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelShape:
    dims = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads}
    extras = (args.kv_heads, args.ffn_dim, args.vocab, args.gated_mlp)
    if args.model is not None:
        if any(v is not None for v in (*dims.values(), *extras)):
            parser.error(
                "give either --model or explicit dims (--layers/--dim/--heads...), not both"
            )
        return get_preset(args.model)
    missing = [flag for flag, value in dims.items() if value is None]
    if missing:
        parser.error(
            f"give --model or all of --layers, --dim, --heads (missing {', '.join(missing)})"
        )
    try:
        return ModelShape(
            name="custom",
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


def _configs_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[SimConfig]:
    model = _model_from_args(parser, args)
    missing = [flag for flag, value in (("--seq-len", args.seq_len), ("--pp", args.pp),
                                        ("--microbatches", args.microbatches)) if value is None]
    if missing:
        parser.error(f"missing required option(s): {', '.join(missing)}")
    memory = MemoryModel(
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
        dropout=args.dropout,
        kv_store=args.kv_store,
        distributed_optimizer=args.distributed_optimizer,
        micro_batch_size=args.micro_batch_size,
    )
    base = dict(
        model=model, seq_len=args.seq_len, pp=args.pp, tp=args.tp, dp=args.dp,
        microbatches=args.microbatches, segments=args.segments, v=args.v,
        partition=args.partition, p2p_latency=args.p2p_latency, align=args.align,
        memory=memory,
    )
    configs = []
    for name in dict.fromkeys(args.schedule):  # de-duplicate, keep order
        try:
            config = SimConfig(schedule=name, **base)
            config.plan()  # segment-length errors surface here, as usage errors
            configs.append(config)
        except NotImplementedError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        except ValueError as error:
            parser.error(str(error))
    return configs


def _print_results(results: list[SimResult]) -> None:
    cfg = results[0].config
    print(
        f"model={cfg.model.name} seq_len={cfg.seq_len} pp={cfg.pp} tp={cfg.tp} dp={cfg.dp} "
        f"m={cfg.microbatches} partition={cfg.partition} p2p_latency={cfg.p2p_latency}"
    )
    print(f"{'schedule':<9} {'k':>2} {'makespan':>9} {'bubble':>7} {'equal-cost':>10} "
          f"{'analytic':>8}  peak GiB per rank (rank 0 activations in microbatches)")
    for r in results:
        peaks = " ".join(f"{b / GIB:6.2f}" for b in r.peak_memory_bytes)
        print(
            f"{r.schedule:<9} {r.config.num_segments:>2} {r.makespan:>9.3f} "
            f"{r.bubble_fraction:>7.4f} {r.equal_cost_bubble_fraction:>10.4f} "
            f"{r.analytic_bubble_fraction:>8.4f}  {peaks}  "
            f"({r.ranks[0].peak_activation_microbatches:.3f})"
        )
        if r.config.num_segments > 1:
            print(f"{'':<9} segment lengths {list(r.segment_lengths)}")


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
        try:
            with open(args.json, "w") as handle:
                json.dump(records, handle, indent=2)
        except OSError as error:
            parser.exit(1, f"{parser.prog}: error: cannot write --json {args.json}: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

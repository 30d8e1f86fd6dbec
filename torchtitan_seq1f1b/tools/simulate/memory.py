# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Bytes on one pipeline rank: model states, and activations and K/V store walked through its order.

What counts and why (Megatron's 18 bytes per parameter, Korthikanti's
per-token activation constants generalised to GQA and SwiGLU, the two K/V
stores, GatedDeltaNet layers' carried state, context parallelism):
docs/simulator.md, "Memory model".
"""

from dataclasses import dataclass
from typing import NamedTuple

from torchtitan_seq1f1b.actions import SegmentAction
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost
from torchtitan_seq1f1b.tools.model_shapes import (
    embedding_params,
    final_norm_params,
    layer_params,
    padded_vocab,
)
from torchtitan_seq1f1b.tools.simulate.config import SimConfig

__all__ = ["GIB", "RankMemory", "layer_carry_bytes", "layer_kv_bytes", "rank_memory"]

GIB = 2**30


@dataclass(frozen=True)
class _StageMemory:
    """Byte sizes on one stage (on one TP rank), derived from a SimConfig."""

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
        # Megatron's and FSDP's optimizer shards span the CP ranks too (dp x cp).
        shards = cfg.dp * cfg.cp if cfg.memory.distributed_optimizer else 1
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
        """Activations a (microbatch, segment) unit keeps on this stage until its backward,
        on one CP rank: its 1/cp share of the queries (and of the score term)."""
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
        return total / cfg.cp

    @property
    def _linear_layers(self) -> float:
        """GatedDeltaNet layers on this stage: the model's share of them, spread evenly."""
        return self._layers * self._model.linear_layers / self._model.n_layers

    def kv_row_bytes(self, dtype_bytes: int) -> float:
        """K and V of one token over this stage's softmax-attention blocks, on one TP rank."""
        return (self._layers - self._linear_layers) * layer_kv_bytes(self.config, dtype_bytes)

    def carry_bytes(self, tail_dtype_bytes: int) -> float:
        """State and conv tail one cut carries over this stage's GatedDeltaNet layers."""
        return self._linear_layers * layer_carry_bytes(self.config, tail_dtype_bytes)


def layer_kv_bytes(config: SimConfig, dtype_bytes: int = 2) -> float:
    """K and V bytes of one token position in one block on one TP rank (``micro_batch_size``
    sequences): what a K/V store row holds, whole (gathered) under CP."""
    model = config.model
    shards = min(config.tp, model.n_kv_heads)
    return 2 * model.kv_dim / shards * dtype_bytes * config.memory.micro_batch_size


def layer_carry_bytes(config: SimConfig, tail_dtype_bytes: int = 2) -> float:
    """Bytes one GatedDeltaNet layer carries across one segment cut on one TP rank
    (``micro_batch_size`` rows): fp32 state and conv tail, heads split by TP."""
    shape = config.linear_attention
    shards = min(config.tp, shape.n_key_heads)
    return shape.carry_bytes(tail_dtype_bytes) / shards * config.memory.micro_batch_size


class RankMemory(NamedTuple):
    """One rank's model states and its peaks over the step, in bytes.

    ``peak_activation_microbatches`` is the activation peak in units of one
    unsplit microbatch's activations over all of the rank's stages.
    """

    model_state_bytes: int
    peak_activation_bytes: float
    peak_kv_bytes: float
    peak_memory_bytes: float
    peak_activation_microbatches: float


def rank_memory(config: SimConfig, plan: SegmentPlan, actions: list[SegmentAction]) -> RankMemory:
    """Walk one rank's order (``actions``, in execution order) and take its peaks.

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
    # carry.py keeps what each later segment starts from, and banks one fp32 gradient of it.
    carry = {s: m.carry_bytes(2) for s, m in stages.items()}
    carry_grad = {s: m.carry_bytes(4) for s, m in stages.items()}

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
            # CP attention keeps the gathered K/V for backward, also torch's at k = 1.
            if k > 1 or config.cp > 1:
                held = plan.seq_len if mem.kv_store == "preallocated" else plan.ends[j]
                kv[(s, i)] = held * kv_row[s] + min(j + 1, k - 1) * carry[s]
            record()
            continue
        if action.kind in "BI" and k > 1 and j == k - 1:
            # KVStore banks fp32 grads of [0, offset_{k-1}); the paper's code keeps a
            # view of the first backward's dK/dV, which spans the whole sequence.
            rows = plan.offsets[-1] if mem.kv_store == "preallocated" else plan.seq_len
            grads[(s, i)] = rows * grad_row[s] + carry_grad[s]
        record()  # the unit's activations are alive until its backward ends
        if action.kind in "BW":  # its last backward step: B, or W after I
            del live[(s, i, j)]
            if j == 0:
                kv.pop((s, i), None)
                grads.pop((s, i), None)
    states = sum(m.model_state_bytes() for m in stages.values())
    return RankMemory(
        states, peaks["act"], peaks["kv"], states + peaks["total"], peaks["act"] / whole
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How long each action takes, priced by FLOPs.

Times are in forwards of one whole microbatch over one rank's share of the
model (``L/p`` blocks, the LM head spread over all stages); backward = 2 x
forward. Attention is causal, or document-masked under packed documents
(``SimConfig.documents``). Under context parallelism a rank computes 1/c of
each unit and adds its K/V collectives. docs/simulator.md, "Timeline model",
says why.
"""

from collections.abc import Callable

from torchtitan_seq1f1b.actions import SegmentAction
from torchtitan_seq1f1b.segmenting import PackedDocumentsCost, SegmentPlan, TransformerCost
from torchtitan_seq1f1b.tools.simulate.config import SimConfig
from torchtitan_seq1f1b.tools.simulate.memory import layer_kv_bytes

__all__ = ["action_duration", "unit_times"]


def _weight_grad_flops(
    cost: TransformerCost | PackedDocumentsCost, length: int, end: int
) -> float:
    """FLOPs of the weight gradients of tokens ``[end - length, end)``.

    A matmul's weight gradient costs as much as its forward, so this is the
    forward minus attention's QK^T and AV, which have no weights.
    """
    return cost.forward_flops(length, end) - cost.attention_flops(length, end)


def unit_times(config: SimConfig, plan: SegmentPlan) -> dict[str, list[float]]:
    """Per-segment time of each action kind ("F", "B", "I", "W") on a stage holding L/p blocks.

    Returns:
        ``{kind: [time of segment j for j in range(k)]}``.
    """
    cost = config.segment_cost
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


def action_duration(config: SimConfig, plan: SegmentPlan) -> Callable[[SegmentAction], float]:
    """Time of one action: its kind's :func:`unit_times` scaled by its stage's share of blocks,
    or, with a calibrated ``config.time_model``, its measured seconds on its stage; on one
    CP rank, with its K/V collectives."""
    if config.time_model is not None:
        return _calibrated_duration(config, plan)
    times = unit_times(config, plan)
    blocks = config.layers_per_stage()
    stage_share = [n * config.pp / config.model.n_layers for n in blocks]
    cp, kv_row = config.cp_cost, layer_kv_bytes(config)
    # Seconds of one time unit: a microbatch's forward over L/p blocks on one rank, no CP.
    rank_flops = config.segment_cost.forward_flops(plan.seq_len, plan.seq_len) / (
        config.pp * config.tp
    )
    unit_seconds = config.memory.micro_batch_size * rank_flops / config.device_flops

    def duration(action: SegmentAction) -> float:
        compute = times[action.kind][action.segment] * stage_share[action.stage]
        exchange = cp.exchange_seconds(action.kind, plan.lengths[action.segment], kv_row)
        return compute / cp.degree + blocks[action.stage] * exchange / unit_seconds

    return duration


def _calibrated_duration(config: SimConfig, plan: SegmentPlan) -> Callable[[SegmentAction], float]:
    blocks, last = config.layers_per_stage(), config.num_stages - 1
    return lambda action: config.time_model.unit_seconds(
        action.kind,
        plan.lengths[action.segment],
        plan.ends[action.segment],
        blocks[action.stage],
        action.stage == last,
        action.stage == 0,
        config.cp_cost,
    )

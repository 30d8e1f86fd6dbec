# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The segment plan of a torchtitan 0.3 job, from its model config (nothing built)."""

from torchtitan.protocols.model import BaseModel
from torchtitan.tools.logging import logger

from torchtitan_seq1f1b.integration.segment_plan import plan_segments, PlannerJob
from torchtitan_seq1f1b.integration.titan_0_3.options import Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.release import sequence_option
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = ["attention_head_dim", "segment_plan_for", "transformer_cost"]


def _mlp_shape(layer) -> dict:
    """TransformerCost's MLP fields of a decoder layer config: dense SwiGLU or MoE."""
    if layer.moe is None:
        return dict(ffn_hidden_dim=layer.feed_forward.w1.out_features)
    moe = layer.moe
    shared = moe.shared_experts
    return dict(
        ffn_hidden_dim=moe.routed_experts.inner_experts.hidden_dim,
        experts=moe.num_experts,
        experts_per_token=moe.router.top_k,
        shared_ffn_hidden_dim=0 if shared is None else shared.w1.out_features,
    )


def _head_shape(attention) -> dict:
    """TransformerCost's head fields of an attention config: GQA, or MLA (deepseek_v3),
    whose K/V have a head per query head and whose V head dim is its own."""
    if hasattr(attention, "v_head_dim"):
        return dict(
            n_kv_heads=attention.n_heads,
            qk_head_dim=attention.qk_nope_head_dim + attention.qk_rope_head_dim,
            v_head_dim=attention.v_head_dim,
        )
    return dict(n_kv_heads=attention.n_kv_heads or attention.n_heads, qk_head_dim=attention.head_dim)


def _window_shape(layers) -> dict:
    """TransformerCost's sliding-window fields: how many layers have one (gpt_oss) and
    the widest window's keys, itself included."""
    windows = [
        size for layer in layers
        if (size := getattr(layer.attention, "sliding_window_size", None)) is not None
    ]
    return dict(window_layers=len(windows), window=max(windows, default=0))


def transformer_cost(model_config: BaseModel.Config) -> TransformerCost:
    """The FLOP model of a torchtitan 0.3 decoder config (llama3, qwen3, qwen3_5,
    deepseek_v3, gpt_oss; dense or MoE).

    MoE counts the experts a token runs; sliding-window layers the keys inside
    their window; qwen3_5's GatedDeltaNet layers are priced as linear attention
    with the softmax layers' heads. Where layers differ otherwise (dense layers
    before MoE ones), the last layer stands for all.
    """
    attention = model_config.first_attention
    layers = model_config.layers
    return TransformerCost(
        n_layers=len(layers),
        dim=model_config.dim,
        n_heads=attention.n_heads,
        vocab_size=model_config.vocab_size,
        **_head_shape(attention),
        **_mlp_shape(layers[-1]),
        **_window_shape(layers),
        linear_layers=sum(getattr(layer, "delta_net", None) is not None for layer in layers),
    )


def attention_head_dim(model_config: BaseModel.Config) -> int:
    """The head dim the attention kernels run at: dim / heads unless set; MLA's
    q/k and v head dims, whichever is wider (the other is zero-padded to it)."""
    cost = transformer_cost(model_config)
    return max(cost.head_dim, cost.value_head_dim)


def segment_plan_for(
    options: Seq1F1BSection,
    seq_len: int,
    tp: int,
    model_config: BaseModel.Config,
    planner_job: PlannerJob | None = None,
    cp: int = 1,
) -> SegmentPlan:
    """The plan ``options`` ask for at ``seq_len`` (:func:`~.release.sequence_length`),
    with lengths that TP degree ``tp`` and CP degree ``cp`` can shard; raises
    :class:`~torchtitan_seq1f1b.integration.segment_plan.Seq1F1BConfigError` naming them.
    ``planner_job`` is needed when the options leave the plan to the planner."""
    return plan_segments(
        options, seq_len, tp, transformer_cost(model_config), planner_job, logger.info, cp,
        sequence_option(),
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's and main's decoders, converted, run segment by segment in float64.

Each model is torchtitan's own debug model cut to two blocks (fewer routed
experts for qwen3's MoE; qwen3_5's third and fourth, a GatedDeltaNet block and
a softmax one, at 2048 tokens), converted by :func:`make_segment_aware`, and run
as a Seq1F1B stage runs one microbatch: segment by segment on a K/V store,
packed documents crossing the segment borders, under torchtitan's activation
checkpointing, every backward on a fresh thread as CUDA's autograd engine
runs it (on main a microbatch is one packed row, cut on dim 0). Logits,
every parameter's gradient and the MoE token counts that drive load
balancing must equal the unsplit run's.

torchtitan's routed experts multiply in bf16 whatever the model's dtype, so
their weight gradients are rounded once per call: once per segment here, once
per microbatch unsplit. The tests run them in float64
(:func:`~tests.integration.titan_0_3.input_dtype_experts.experts_in_input_dtype`).
qwen3_5's norms compute in float32 likewise, summing their weight gradients over
a segment's tokens in float32; the tests run them in float64 too. Routing,
dispatch, combine and everything else run as torchtitan wrote them.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel, gpt_oss_debugmodel_flex
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.models.qwen3_5 import OffsetRMSNorm, RMSNormGated

from torchtitan_seq1f1b.attention import bind_documents
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.integration import titan_release
from torchtitan_seq1f1b.integration.segment_plan import Seq1F1BConfigError
from torchtitan_seq1f1b.integration.titan_0_3.attention import (
    make_segment_aware,
    positions_document_ids,
)
from torchtitan_seq1f1b.integration.titan_0_3.checkpointing import saving_attention
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED, SEQ_DIM
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import attention_head_dim, transformer_cost
from torchtitan_seq1f1b.integration.titan_0_3.torchtitan_configs import import_registry
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import text_only_inputs
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.harness import assert_close
from tests.integration.titan_0_3.fewer_experts import with_experts
from tests.integration.titan_0_3.input_dtype_experts import (
    experts_in_input_dtype,
    gpt_oss_experts_in_input_dtype,
)
from tests.integration.titan_0_3.smaller_vocab import with_vocab

PLAN = SegmentPlan.from_lengths((11, 5, 16))
# Per row of the microbatch: document lengths summing to the plan's 32 tokens; on
# main a microbatch is one packed row.
DOCUMENTS = ((7, 13, 12),) if FOLDED else ((7, 13, 12), (32,))
# tokens, positions: (rows, seq_len), on main (seq_len,).
SHAPE = (PLAN.seq_len,) if FOLDED else (len(DOCUMENTS), PLAN.seq_len)
# torchtitan's MoE combine rounds each routed output to float32 before weighting it
# (token_dispatcher.py), so inputs differing by float64 summation order (~1e-15) round a
# few of them apart: gpt_oss differs by up to 2e-10. A wrong segment differs by > 1e-4.
RTOL = 1e-8
CHECKPOINTING = {
    "none": None,
    "full": FullAC.Config(),
    "selective": saving_attention(SelectiveAC.Config()),
}

WINDOW = 6  # keys a sliding-window query sees, itself included: it crosses segment borders
# qwen3_5's registry, imported as the adapter does: its dataloader imports torchvision.
QWEN3_5 = import_registry("qwen3_5", "qwen35_debugmodel")


def _small_window(layer):
    """A gpt_oss block config whose sliding window (if it has one) is WINDOW keys wide."""
    attention = layer.attention
    if attention.sliding_window_size is None:
        return layer
    inner = dataclasses.replace(attention.inner_attention, window_size=(WINDOW - 1, 0))
    return dataclasses.replace(
        layer,
        attention=dataclasses.replace(attention, sliding_window_size=WINDOW, inner_attention=inner),
    )


def _model(
    job, num_experts: int | None = None, change_layer=None, first: int = 0
) -> torch.nn.Module:
    """The job's model, two blocks from ``first`` (each changed by ``change_layer``),
    float64, initialised from seed 0."""
    config = job().model_spec.model
    layers = config.layers[first : first + 2]
    if num_experts is not None:
        layers = [with_experts(layer, num_experts) for layer in layers]
    if change_layer is not None:
        layers = [change_layer(layer) for layer in layers]
    config = dataclasses.replace(config, layers=layers)
    torch.manual_seed(0)
    # Built in float64, so that complex RoPE tables become complex128, not real.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = config.build()
        model.init_states()
    finally:
        torch.set_default_dtype(default_dtype)
    # qwen3_5's forward wants the image and video token ids, images or not.
    return text_only_inputs(lambda model: model)(model)


def _qwen3_5(job):
    """A qwen3_5 job at the shipped tokenizer's 2048 tokens, as the torchrun tests run it."""
    def cut():
        config = job()
        with_vocab(config)
        return config
    return cut


def _text_decoder(model):
    """qwen3_5 without its vision encoder, as Seq1F1B's stages hold it: text gives it no
    gradient."""
    model.vision_encoder = None
    return model

MODELS = {
    # GQA with head_dim 128 at dim 256, q/k norms; routed experts, top 8 of 16, softmax routing.
    "qwen3-moe": lambda: _model(qwen3_moe_debug, num_experts=16),
    # MLA (q/k head dim 192, v 128, yarn RoPE scale); a dense block, then shared + routed experts.
    "deepseek_v3": lambda: _model(deepseek_v3_debugmodel),
    # Attention sinks (head_dim 64, GQA), a sliding-window block and a full one; biased
    # experts, top 4 of 4.
    "gpt_oss": lambda: _model(gpt_oss_debugmodel, num_experts=4, change_layer=_small_window),
    # A GatedDeltaNet block (state and conv tail across segments) and a gated softmax
    # one with partial RoPE; its norms in float64 (module docstring).
    "qwen3_5": lambda: _text_decoder(_model(_qwen3_5(QWEN3_5.qwen35_debugmodel), first=2)),
    # The same with routed experts (top 2 of 8) and a sigmoid-gated shared expert.
    "qwen3_5-moe": lambda: _text_decoder(
        _model(_qwen3_5(QWEN3_5.qwen35_debugmodel_moe), first=2)
    ),
}
# MoE layers of each model's two blocks.
MOE_LAYERS = {"qwen3-moe": 2, "deepseek_v3": 1, "gpt_oss": 2, "qwen3_5": 0, "qwen3_5-moe": 2}

def _batch(model) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens and per-document positions, :data:`SHAPE`."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, SHAPE, generator=gen)
    positions = torch.cat([torch.arange(length) for lengths in DOCUMENTS for length in lengths])
    return tokens, positions.view(SHAPE)

class _PositionsAsInput(torch.nn.Module):
    """The model called with (tokens, positions), both cut into segments."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, positions=positions)


def _moe_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "tokens_per_expert_E")]

def _run(model, segmented: bool, grad_out: torch.Tensor | None):
    tokens, positions = _batch(model)
    ids = positions_document_ids(positions)
    model.zero_grad(set_to_none=True)
    for moe in _moe_layers(model):
        moe.tokens_per_expert_E.zero_()

    forward = _PositionsAsInput(model)
    with backward_on_fresh_thread():
        if segmented:
            store = KVStore()
            run = SegmentedRun(
                forward, [tokens, positions], PLAN, store, seq_dim=SEQ_DIM, document_ids=ids
            )
            out, _ = run.run(grad_out)
            assert len(store) == 0
        else:
            bind_documents(model, ids)
            out = forward(tokens, positions)
            out.backward(grad_out)
            out = out.detach()
            bind_documents(model, None)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out, grads, [moe.tokens_per_expert_E.clone() for moe in _moe_layers(model)]

def _offset_norm_in_input_dtype(self: OffsetRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``OffsetRMSNorm.forward`` in x's dtype: (1 + weight) * rmsnorm(x) over the last dim."""
    return (1 + self.weight) * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)


def _gated_norm_in_input_dtype(self: RMSNormGated, x: torch.Tensor, gate: torch.Tensor):
    """``RMSNormGated.forward`` in x's dtype: weight * rmsnorm(x) * silu(gate)."""
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
    return self.weight * normed * F.silu(gate)


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
@pytest.mark.parametrize("name", list(MODELS))
def test_segmented_model_matches_unsplit(name, checkpointing, monkeypatch):
    monkeypatch.setattr(GroupedExperts, "forward", experts_in_input_dtype)
    monkeypatch.setattr(GptOssGroupedExperts, "forward", gpt_oss_experts_in_input_dtype)
    monkeypatch.setattr(OffsetRMSNorm, "forward", _offset_norm_in_input_dtype)
    monkeypatch.setattr(RMSNormGated, "forward", _gated_norm_in_input_dtype)
    model = MODELS[name]()
    assert make_segment_aware(model, "sdpa") == 2
    if CHECKPOINTING[checkpointing] is not None:
        CHECKPOINTING[checkpointing].build().apply(model)
    model.train()
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(*SHAPE, model.config.vocab_size, generator=gen, dtype=torch.float64)
    ref_out, ref_grads, ref_counts = _run(model, False, grad_out)
    out, grads, counts = _run(model, True, grad_out)
    family = f"torchtitan {titan_release()} {name}"
    assert_close(out, ref_out, family, RTOL)
    for param, ref in ref_grads.items():
        assert_close(grads[param], ref, family, RTOL, what=f"grad of {param}")
    assert len(counts) == MOE_LAYERS[name]
    for layer, (count, ref) in enumerate(zip(counts, ref_counts)):
        assert ref.sum() > 0
        assert torch.equal(count, ref), f"MoE layer {layer}: token counts {count} != {ref}"

@pytest.mark.parametrize("job", [gpt_oss_debugmodel, gpt_oss_debugmodel_flex], ids=["varlen", "flex"])
def test_gpt_oss_keeps_its_sliding_windows(job):
    """varlen attention holds its window as window_size, flex as the block's mask key."""
    with torch.device("meta"):
        model = job().model_spec.model.build()
    make_segment_aware(model, "sdpa")
    windows = {name: block.attention.inner_attention.window_left for name, block in model.layers.items()}
    assert windows == {"0": 127, "1": None, "2": 127, "3": None}


class _Recurrent(torch.nn.Module):
    """A token mixer that is neither softmax attention nor qwen3_5's GatedDeltaNet."""


def test_an_unknown_token_mixer_is_refused_by_type():
    with torch.device("meta"):
        model = llama3_debugmodel().model_spec.model.build()
    model.layers["1"].attention = _Recurrent()
    with pytest.raises(Seq1F1BConfigError) as error:
        make_segment_aware(model, "sdpa")
    assert (
        "layers.1 (_Recurrent): neither softmax attention nor qwen3_5's GatedDeltaNet"
    ) in str(error.value)
    assert "layers.0" not in str(error.value)


def test_qwen3_5_converts_to_the_same_parameters_and_initialisation():
    """Converted before initialisation, as the pipelining function converts a model
    on the meta device, qwen3_5 holds the same parameters under the same names as
    torchtitan's and initialises them to the same values from the same seed."""
    config = _qwen3_5(QWEN3_5.qwen35_debugmodel)().model_spec.model

    def initialised(convert: bool) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = config.build()
        if convert:
            assert make_segment_aware(model, "sdpa") == 8
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_states()
        return model.state_dict()

    converted, original = initialised(True), initialised(False)
    assert converted.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(converted[name], value), name


@pytest.mark.parametrize(
    "job, expected, kernel_head_dim",
    [
        (qwen3_moe_debug, dict(n_heads=16, n_kv_heads=8, head_dim=128, value_head_dim=128,
                               experts=64, experts_per_token=8, shared_ffn_hidden_dim=0), 128),
        (deepseek_v3_debugmodel, dict(n_heads=16, n_kv_heads=16, head_dim=192, value_head_dim=128,
                                      experts=8, experts_per_token=3, shared_ffn_hidden_dim=512), 192),
        (gpt_oss_debugmodel, dict(n_heads=64, n_kv_heads=8, head_dim=64, experts=8,
                                  experts_per_token=4, window_layers=2, window=128), 64),
        # Six GatedDeltaNet layers, priced per token; two softmax ones of 4 x 64 heads.
        (QWEN3_5.qwen35_debugmodel, dict(n_layers=8, dim=256, n_heads=4, n_kv_heads=2,
                                         head_dim=64, linear_layers=6), 64),
    ],
    ids=["qwen3-moe", "deepseek_v3", "gpt_oss", "qwen3_5"],
)
def test_cost_model_reads_each_models_heads_and_experts(job, expected, kernel_head_dim):
    """The FLOP model behind balanced plans, the simulator and the planner."""
    config = job().model_spec.model
    cost = transformer_cost(config)
    assert {name: getattr(cost, name) for name in expected} == expected
    assert attention_head_dim(config) == kernel_head_dim

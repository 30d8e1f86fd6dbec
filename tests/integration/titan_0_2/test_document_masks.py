# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.2.2's block-causal llama3 models, converted to segment-aware
attention with document ids, against torchtitan's own masks (in-process, float64).

tests/integration/test_block_causal.py trains them under torchrun.
"""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.distributed import ParallelDims
from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod
from torchtitan.models.llama3 import llama3_args, Transformer
from torchtitan.models.llama3.model.model import Attention

from torchtitan_seq1f1b.attention import bind_documents, SegmentAwareAttention
from torchtitan_seq1f1b.integration.titan_0_2.attention import (
    eos_document_ids,
    make_segment_aware,
    parallelize_with_document_ids,
)

from tests.harness import assert_close

EOS = 1
TOKENIZER = SimpleNamespace(eos_id=EOS)


def tokens_with_documents(seed: int = 0) -> torch.Tensor:
    """(4, 48) tokens: EOS first, last, twice in a row, nowhere; rows differ."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 32, (4, 48), generator=generator)
    for row, positions in enumerate([[0, 9, 10, 30], [47], [], [5, 17, 29, 41]]):
        tokens[row, positions] = EOS
    return tokens


def torchtitan_mask(tokens: torch.Tensor) -> torch.Tensor:
    """(batch, seq_len, seq_len) bool: torchtitan's block_causal mask_mods, evaluated."""
    batch, seq_len = tokens.shape
    document = get_document_mask_mod(tokens, EOS)
    causal = get_causal_mask_mod()
    b = torch.arange(batch)[:, None, None]
    q = torch.arange(seq_len)[None, :, None]
    kv = torch.arange(seq_len)[None, None, :]
    return causal(b, 0, q, kv) & document(b, 0, q, kv)


def test_eos_document_ids_are_torchtitans_documents():
    tokens = tokens_with_documents()
    ids = eos_document_ids(tokens, EOS)
    assert ids.shape == tokens.shape and ids.dtype == torch.int64
    assert (ids[:, 1:] >= ids[:, :-1]).all()
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    same_document = ids[:, :, None] == ids[:, None, :]
    assert torch.equal(same_document & causal, torchtitan_mask(tokens))
    # An EOS ends its own document: the next token starts a new one.
    assert ids[0, :12].tolist() == [0] + [1] * 9 + [2, 3]
    assert (ids[2] == 0).all() and (ids[1] == 0).all()


class ExplicitMaskAttention(nn.Module):
    """torchtitan's block_causal mask as a dense SDPA mask: the reference."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask[:, None], enable_gqa=enable_gqa
        )


def llama(flavor: str, **overrides) -> Transformer:
    args = dataclasses.replace(
        llama3_args[flavor], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32,
        max_seq_len=48, **overrides,
    )
    torch.manual_seed(0)
    model = Transformer(args).double()
    with torch.no_grad():
        model.init_weights()
    return model


def forward_and_grads(model, tokens, **kwargs):
    model.zero_grad()
    out = model(tokens, **kwargs)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("flavor", ["debugmodel_flex_attn", "debugmodel_varlen_attn"])
def test_converted_model_is_torchtitans_block_causal_model(flavor):
    tokens = tokens_with_documents()
    model = llama(flavor)
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, Attention):
            module.attn_type = "sdpa"
            module.inner_attention = ExplicitMaskAttention(torchtitan_mask(tokens))

    assert make_segment_aware(model, "sdpa") == 2
    assert all(isinstance(m.inner_attention, SegmentAwareAttention)
               for m in model.modules() if isinstance(m, Attention))
    assert model.model_args.attn_type != "sdpa"  # the trainer still asks for masks
    ids = model.get_attention_masks(input_batch=tokens, tokenizer=TOKENIZER, extra_inputs=None)
    assert torch.equal(ids, eos_document_ids(tokens, EOS))

    bind_documents(model, ids)
    out, grads = forward_and_grads(model, tokens)
    expected, expected_grads = forward_and_grads(reference, tokens)
    assert_close(out, expected, "block_causal output")
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, "block_causal grad", what=name)
    # Without the documents it is causal attention over the window, which differs.
    bind_documents(model, None)
    assert (model(tokens) - expected).abs().max() > 1e-3


def test_converted_model_forward_equals_torchtitans_flex_forward():
    """flex runs forward (not backward) on CPU: compare with torchtitan itself."""
    tokens = tokens_with_documents(seed=1)
    model = llama("debugmodel_flex_attn").float()
    with torch.no_grad():
        expected = model(tokens, attention_masks=model.get_attention_masks(tokens, TOKENIZER))
        make_segment_aware(model, "sdpa")
        bind_documents(model, model.get_attention_masks(tokens, TOKENIZER))
        out = model(tokens)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_flex_with_a_causal_mask_is_one_document_per_row():
    tokens = tokens_with_documents()
    model = llama("debugmodel_flex_attn", attn_mask_type="causal")
    plain = llama("debugmodel")
    make_segment_aware(model, "sdpa")
    ids = model.get_attention_masks(tokens, TOKENIZER)
    assert (ids == 0).all()
    bind_documents(model, ids)
    with torch.no_grad():
        assert_close(model(tokens), plain(tokens), "flex causal")


def _dims(pp: int = 1, cp: int = 1) -> ParallelDims:
    return ParallelDims(
        dp_shard=1, dp_replicate=1, cp=cp, tp=1, pp=pp, ep=1, etp=1, world_size=pp * cp
    )


JOB = SimpleNamespace(model=SimpleNamespace(flavor="f"), seq1f1b=SimpleNamespace(attention_backend="sdpa"))


def test_unpipelined_cpu_model_binds_the_documents_it_is_given():
    tokens = tokens_with_documents()
    calls = []
    parallelize = parallelize_with_document_ids(lambda m, dims, job: calls.append(m) or m)
    model = llama("debugmodel_flex_attn")
    reference = copy.deepcopy(model)
    make_segment_aware(reference, "sdpa")
    assert parallelize(model, _dims(), JOB) is model and calls == [model]
    ids = model.get_attention_masks(tokens, TOKENIZER)
    with torch.no_grad():
        out = model(tokens, attention_masks=ids)  # as torchtitan's trainer calls it
        bind_documents(reference, ids)
        assert_close(out, reference(tokens), "hooked forward")
        assert (model(tokens, attention_masks=torch.zeros_like(ids)) - out).abs().max() > 1e-3


def test_unpipelined_wrapper_leaves_other_models_and_pipeline_parts_alone():
    parallelize = parallelize_with_document_ids(lambda m, dims, job: m)
    for model, dims in [(llama("debugmodel"), _dims()), (llama("debugmodel_flex_attn"), _dims(pp=2))]:
        parallelize(model, dims, JOB)
        assert not any(isinstance(m, SegmentAwareAttention) for m in model.modules())
        assert not model._forward_pre_hooks
    with pytest.raises(ValueError, match="model.flavor='f' on CPU: parallelism.context_parallel_degree=2"):
        parallelize(llama("debugmodel_flex_attn"), _dims(cp=2), JOB)

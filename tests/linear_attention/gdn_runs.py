# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the linear-attention tests share: a tiny float64 GatedDeltaNet layer, packed
document layouts, relative errors, and one microbatch run unsplit or segment by
segment as a stage runs it (full or split backward, checkpointed or not, every
backward on a fresh thread as on CUDA)."""

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchtitan_seq1f1b._torch_compat import stage_backward_input, stage_backward_weight
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention, bind_documents
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig, SegmentAwareGatedDeltaNet
from torchtitan_seq1f1b.segmenting import SegmentPlan

F64 = torch.float64
RTOL = 1e-10
# Worst relative error per check family, printed by the modules' teardown (-s).
WORST: dict[str, float] = defaultdict(float)

# Two value heads sharing one key head (the repeat qwen3_5 does); conv over 3 + 3 + 4 channels.
CONFIG = GatedDeltaNetConfig(dim=6, n_key_heads=1, n_value_heads=2, key_head_dim=3, value_head_dim=2)
SEQ_LEN = 11
PLANS = {
    "k1": SegmentPlan.from_lengths((11,)),
    "k2": SegmentPlan.from_lengths((7, 4)),
    # Segments of 1 and 2 tokens: a conv tail reaches back over two segments.
    "k4": SegmentPlan.from_lengths((4, 1, 2, 4)),
    "k4-short-first": SegmentPlan.from_lengths((1, 2, 1, 7)),
}
# Document lengths per row, rows laid out differently: a document crossing cuts
# (4 | 5 | 7), documents starting exactly at cuts 4 and 7 (and 1, 3 of the short plan),
# documents of 1 to 3 tokens.
DOCUMENTS = ((6, 5), (4, 3, 4), (1, 2, 3, 1, 2, 2))


def document_ids(lengths_per_row=DOCUMENTS) -> torch.Tensor:
    """(rows, SEQ_LEN) ids: row r holds documents of ``lengths_per_row[r]`` tokens."""
    return torch.stack([
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in lengths_per_row
    ])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_close(actual, expected, family: str, what: str = "", rtol: float = RTOL) -> None:
    err = rel_err(actual.detach(), expected.detach())
    WORST[family] = max(WORST[family], err)
    assert err <= rtol, f"{family} {what}: relative error {err:.3e} > {rtol:.1e}"


def report_worst(families: list[str]) -> None:
    for family in families:
        if family in WORST:
            print(f"\n{family}: worst relative error {WORST[family]:.2e}")


def make_layer(seed: int = 0, config: GatedDeltaNetConfig = CONFIG) -> SegmentAwareGatedDeltaNet:
    """The tiny float64 layer, every parameter drawn from N(0, 0.5^2)."""
    layer = SegmentAwareGatedDeltaNet(config).to(F64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=F64))
    return layer


def layer_inputs(batch: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the output's gradient, (batch, SEQ_LEN, dim) each."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, SEQ_LEN, CONFIG.dim)
    return tuple(torch.randn(shape, generator=generator, dtype=F64) for _ in range(2))


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


@dataclass
class Result:
    out: torch.Tensor
    grad_x: torch.Tensor
    grads: dict[str, torch.Tensor]  # every parameter's


def _result(layer: nn.Module, out: torch.Tensor, grad_x: torch.Tensor) -> Result:
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return Result(out.detach(), grad_x, grads)


def unsplit(layer: SegmentAwareGatedDeltaNet, x, grad_out, ids=None) -> Result:
    """The layer on whole rows (with ``ids``' packed documents)."""
    layer.zero_grad(set_to_none=True)
    bind_documents(layer, ids)
    leaf = x.clone().requires_grad_()
    out = layer(leaf)
    out.backward(grad_out)
    return _result(layer, out, leaf.grad)


def segmented(
    layer: SegmentAwareGatedDeltaNet,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    plan: SegmentPlan,
    ids: torch.Tensor | None = None,
    split: str | None = None,
    checkpointed: bool = False,
    store: KVStore | None = None,
    compiled: bool = False,
) -> Result:
    """The layer over one microbatch cut by ``plan``: every forward in order, then every
    backward last to first, each under its unit and on a fresh thread. ``split``: each
    backward in an input-gradient and a weight-gradient step, either "deferred" (every
    input-gradient step, last to first, then the weight-gradient steps first to last,
    an order no backward runs in) or "paired" (each weight-gradient step right after
    its segment's input-gradient step). ``compiled``: the layer under
    ``torch.compile(fullgraph=True)``, dynamo only (the cheapest compile on CPU).
    The store is freed at the end."""
    layer.zero_grad(set_to_none=True)
    store = KVStore() if store is None else store
    fn = Checkpointed(layer) if checkpointed else layer
    if compiled:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    with backward_on_fresh_thread():
        if not split:
            run = SegmentedRun(fn, [x], plan, store, document_ids=ids)
            out, (grad_x,) = run.run(grad_out)
            return _result(layer, out, grad_x)
        bind_attention(layer, store)
        documents = None if ids is None else MicrobatchDocuments(ids, plan)
        units = [RunningUnit(Unit(0, j), plan, documents) for j in range(plan.num_segments)]
        leaves, outs, groups = [], [], {}
        for unit, cut in zip(units, plan.slices()):
            leaves.append(x[:, cut].clone().requires_grad_())
            with store.running_unit(unit):
                outs.append(fn(leaves[-1]))
        result = torch.cat([out.detach() for out in outs], dim=1)
        steps = [(kind, j) for j in reversed(range(plan.num_segments)) for kind in "IW"]
        if split == "deferred":
            steps = [("I", j) for j in reversed(range(plan.num_segments))]
            steps += [("W", j) for j in range(plan.num_segments)]
        for kind, j in steps:
            with store.running_unit(units[j]):
                if kind == "I":
                    _, groups[j] = stage_backward_input(
                        [outs[j]], [grad_out[:, plan.slices()[j]]], [leaves[j]], iter(layer.parameters())
                    )
                else:
                    stage_backward_weight(iter(layer.parameters()), groups[j])
        store.free(0)
        return _result(layer, result, torch.cat([leaf.grad for leaf in leaves], dim=1))


def compare(found: Result, expected: Result, family: str, rtol: float = RTOL) -> None:
    """Output, input gradient and every parameter gradient within ``rtol``."""
    assert_close(found.out, expected.out, family, "out", rtol)
    assert_close(found.grad_x, expected.grad_x, family, "grad of x", rtol)
    assert found.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert_close(found.grads[name], grad, family, f"grad of {name}", rtol)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A GatedDeltaNet layer run segment by segment through the K/V store equals the unsplit
layer: output, input gradient and every parameter gradient, float64, rtol 1e-10.

Segments run forward first to last, then backward last to first, as one stage runs a
microbatch under any Seq1F1B schedule; every backward on a fresh thread as on CUDA.
Plans of 1, 2 and 4 uneven segments, some shorter than the conv's 3-token tail; rows
with documents crossing cuts, starting at cuts and of 1 to 3 tokens. Split backwards
(every input-gradient step, then the weight-gradient steps) and activation
checkpointing, whose recomputes (in every backward step) must read the carries and
keep nothing again. Negative controls: the state, the conv tail or both reset at
every segment must fail. With ``merge_single_token_documents`` the layer restarts where
torchtitan main's qwen3_5 does.
"""

from dataclasses import replace

import pytest
import torch

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.linear_attention import ops
from torchtitan_seq1f1b.linear_attention.backends import ExactRecurrence
from torchtitan_seq1f1b.linear_attention.carry import Carry, LayerCarries

from tests.linear_attention.gdn_runs import (
    CONFIG,
    compare,
    SEQ_LEN,
    document_ids,
    layer_inputs,
    make_layer,
    PLANS,
    rel_err,
    report_worst,
    segmented,
    unsplit,
)

FAMILIES = ["segmented vs unsplit", "split backward / checkpointed vs unsplit"]


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    report_worst(FAMILIES)


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_segments_equal_the_unsplit_layer(plan, documents):
    layer = make_layer()
    x, grad_out = layer_inputs()
    ids = document_ids() if documents else None
    expected = unsplit(layer, x, grad_out, ids)
    compare(segmented(layer, x, grad_out, PLANS[plan], ids), expected, FAMILIES[0])


# One-token documents first in a row (kept), inside it, two in a row, at the cut at 5
# and last in the row.
SINGLE_TOKEN_DOCUMENTS = ((1, 3, 1, 1, 4, 1), (2, 1, 2, 1, 4, 1), (5, 1, 5))


def main_restarts(ids: torch.Tensor) -> torch.Tensor:
    """(rows, SEQ_LEN) ids of the documents main's qwen3_5 restarts its GatedDeltaNet at:
    a row's first token, and each position 0 followed by a position 1."""
    rows = []
    for row in ids.tolist():
        positions = [0 if t == 0 or row[t] != row[t - 1] else None for t in range(SEQ_LEN)]
        for t in range(1, SEQ_LEN):
            positions[t] = 0 if positions[t] == 0 else positions[t - 1] + 1
        starts = [t == 0 or (positions[t] == 0 and t + 1 < SEQ_LEN and positions[t + 1] == 1)
                  for t in range(SEQ_LEN)]
        rows.append(torch.tensor(starts).cumsum(0) - 1)
    return torch.stack(rows)


@pytest.mark.parametrize("plan", ["k1", "k4"])
def test_merged_single_token_documents_restart_where_main_does(plan):
    """Segmented (k = 4) and whole rows, the merging layer on the ids equals the plain
    layer on the ids main's rule gives; the plain layer on the ids does not."""
    merging = make_layer(config=replace(CONFIG, merge_single_token_documents=True))
    x, grad_out = layer_inputs()
    ids = document_ids(SINGLE_TOKEN_DOCUMENTS)
    expected = unsplit(make_layer(), x, grad_out, main_restarts(ids))
    compare(segmented(merging, x, grad_out, PLANS[plan], ids), expected, FAMILIES[0])
    compare(unsplit(merging, x, grad_out, ids), expected, FAMILIES[0])
    assert rel_err(unsplit(make_layer(), x, grad_out, ids).out, expected.out) > 1e-2


@pytest.mark.parametrize(
    "split, checkpointed",
    [("deferred", False), (None, True), ("deferred", True), ("paired", True)],
    ids=["split", "checkpointed", "split-deferred+checkpointed", "split-paired+checkpointed"],
)
def test_split_backward_and_checkpointing(split, checkpointed, monkeypatch):
    """Every recompute (checkpointing recomputes a segment in its backward and in each
    weight-gradient step, once per parameter group) starts from the kept carries and keeps
    none again; weight-gradient steps deferred or right after the input-gradient step."""
    plan = PLANS["k4"]
    layer = make_layer()
    x, grad_out = layer_inputs()
    ids = document_ids()
    expected = unsplit(layer, x, grad_out, ids)

    kept, forwards = [], []
    keep = Carry.keep
    monkeypatch.setattr(Carry, "keep", lambda self, *a: kept.append(keep(self, *a)) or kept[-1])
    forward = ExactRecurrence.forward

    def counted(*args):  # a hook on the layer would miss recomputes, which stop after the op
        forwards.append(layer.kv_store.running.unit.segment)
        return forward(*args)

    monkeypatch.setattr(ExactRecurrence, "forward", counted)
    compare(segmented(layer, x, grad_out, plan, ids, split, checkpointed), expected, FAMILIES[1])
    last = plan.num_segments - 1
    recomputed = forwards[plan.num_segments :]
    if checkpointed:
        # In the backward, and again in the weight-gradient step when split.
        assert all(recomputed.count(j) >= (2 if split else 1) for j in range(plan.num_segments))
    else:
        assert recomputed == []
    # Conv tail and state kept once for each segment after the first, never by a recompute.
    assert kept.count(True) == 2 * last
    assert kept.count(False) == 2 * sum(j != last for j in recomputed)


def test_the_store_keeps_the_carries_until_the_microbatch_is_freed():
    """Per segment after the first its conv tail and state; in backward one gradient of each."""
    plan = PLANS["k4"]
    layer, store = make_layer(), KVStore()
    x, grad_out = layer_inputs()
    segmented(layer, x, grad_out, plan, store=store)
    batch = x.shape[0]
    channels = 2 * CONFIG.n_key_heads * CONFIG.key_head_dim + CONFIG.n_value_heads * CONFIG.value_head_dim
    tail = batch * (CONFIG.conv_kernel_size - 1) * channels * 8
    state = batch * CONFIG.n_value_heads * CONFIG.key_head_dim * CONFIG.value_head_dim * 8
    assert len(store) == 0 and store.nbytes == 0
    assert store.peak_bytes == plan.num_segments * (tail + state)


class _Forgetful(Carry):
    """A carry that every segment ignores: it starts from zeros."""

    def incoming(self, segment):
        return None


@pytest.mark.parametrize("forgets", ["state", "conv_tail", "both"])
def test_resetting_at_every_segment_fails(forgets, monkeypatch):
    """Negative control: a segment that starts from a zero state, a zero conv tail or
    both (as an unsplit layer on each segment would) is far from the unsplit layer."""

    class Carries(LayerCarries):
        def __init__(self):
            super().__init__()
            for name in ("state", "conv_tail") if forgets == "both" else (forgets,):
                setattr(self, name, _Forgetful())

    monkeypatch.setattr(ops, "LayerCarries", Carries)
    layer = make_layer()
    x, grad_out = layer_inputs()
    expected = unsplit(layer, x, grad_out)
    found = segmented(layer, x, grad_out, PLANS["k4"])
    assert rel_err(found.out, expected.out) > 1e-2
    assert rel_err(found.grad_x, expected.grad_x) > 1e-2


def test_segments_out_of_order_raise():
    """A segment's forward before its predecessor's, or its backward before its
    successor's, raises instead of starting from zeros."""
    layer, store = make_layer(), KVStore()
    bind_attention(layer, store)
    plan = PLANS["k2"]
    x, _ = layer_inputs()
    with store.running_unit(RunningUnit(Unit(0, 1), plan)), pytest.raises(RuntimeError, match="in order"):
        layer(x[:, 7:])
    outs = []
    for j, cut in enumerate(plan.slices()):
        with store.running_unit(RunningUnit(Unit(0, j), plan)):
            outs.append(layer(x[:, cut].clone().requires_grad_()))
    first = RunningUnit(Unit(0, 0), plan)
    with store.running_unit(first), pytest.raises(RuntimeError, match="last to first"):
        outs[0].sum().backward()


def test_compiled_layer_sees_the_ops_as_opaque_calls():
    """``fullgraph=True``: dynamo traces the layer (the ops through their fake kernels)
    without reaching the store; segmented with documents, it equals the eager unsplit layer."""
    layer = make_layer()
    x, grad_out = layer_inputs()
    ids = document_ids()
    expected = unsplit(layer, x, grad_out, ids)
    compare(segmented(layer, x, grad_out, PLANS["k2"], ids, compiled=True), expected, FAMILIES[1])

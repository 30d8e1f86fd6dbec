# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware attention over packed documents, against an explicit block-causal mask.

Segmented runs (forward segment by segment, backward last to first) through
every backend -- the exact path and the GPU adapters through their CPU
stand-ins -- must equal SDPA with an explicit (batch, 1, L, L) mask in
float64; varlen kernels must receive only each row's keys from its first
needed document on; the unsplit model gets the same semantics from
``bind_documents``.
"""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchtitan_seq1f1b.attention import bind_documents, SegmentAwareAttention
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.harness import assert_close, attention_inputs, make_backend, output_and_grads, SegmentedRun

LAYOUTS = {
    "crossing": ((3, 11, 10), (24,)),
    "short": ((2, 3, 1, 4, 2, 5, 3, 4), (1,) * 24),
    "aligned": ((10, 6, 8), (7, 17)),
    "one per row": ((10, 14), (10, 14)),
}
PLANS = {"uneven": SegmentPlan.from_lengths((10, 6, 8)), "uniform": SegmentPlan.uniform(24, 4)}
KINDS = ("sdpa", "flash", "varlen", "cuda_exact")


def _ids(rows) -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(r) for _ in range(n)] for r in rows])


def block_causal(q, k, v, ids):
    """(batch, heads, L, head_dim) attention with an explicit block-causal mask."""
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v):
        return checkpoint(self.inner, q, k, v, use_reentrant=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout, plan_name", list(itertools.product(LAYOUTS, PLANS)))
@pytest.mark.parametrize("n_kv", [4, 2])
def test_segmented_matches_block_causal(kind, layout, plan_name, n_kv):
    plan, ids = PLANS[plan_name], _ids(LAYOUTS[layout])
    inputs, grad_out = attention_inputs(2, 4, n_kv, plan.seq_len, seed=70)
    ref, ref_grads = output_and_grads(lambda q, k, v: block_causal(q, k, v, ids), inputs, grad_out)
    backend, fake = make_backend(kind)
    store = KVStore()
    out, grads = SegmentedRun(
        Checkpointed(SegmentAwareAttention(backend)), inputs, plan, store, 0, seq_dim=2,
        document_ids=ids,
    ).run(grad_out)
    family = f"documents {kind}"
    assert_close(out, ref, family, what="out")
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert_close(g, rg, family, what=f"grad of input {i}")
    assert len(store) == 0
    varlen = getattr(backend, "varlen_fake", None)
    if varlen is not None:
        # One call per segment whose rows are not each one document from the
        # same key, all rows together (recompute repeats the calls); its
        # sequences with queries are each row's documents from the first needed one.
        expected = [_row_documents(ids, start, end) for start, end in zip(plan.offsets, plan.ends)]
        expected = [docs for docs in expected if not _dense(docs)]
        calls = varlen.calls[: len(expected)]
        assert [[s for s in c["sequences"] if s[0]] for c in calls] == [
            [s for row in docs for s in row] for docs in expected
        ]


def _row_documents(ids: torch.Tensor, start: int, end: int) -> list[list[tuple[int, int]]]:
    """Per row, the (queries, keys) of each document meeting ``[start, end)``."""
    rows = []
    for row in ids.tolist():
        docs = []
        for doc in sorted(set(row)):
            first, last = row.index(doc), len(row) - row[::-1].index(doc)
            if first < end and last > start:
                docs.append((min(last, end) - max(first, start), min(last, end) - first))
        rows.append(docs)
    return rows


def _dense(rows: list[list[tuple[int, int]]]) -> bool:
    return all(len(docs) == 1 for docs in rows) and len({docs[0][1] for docs in rows}) == 1


def test_segmented_check_fails_without_documents():
    """Negative control: the same run without document ids is causal across documents."""
    plan, ids = PLANS["uneven"], _ids(LAYOUTS["short"])
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=71)
    ref, _ = output_and_grads(lambda q, k, v: block_causal(q, k, v, ids), inputs, grad_out)
    out, _ = SegmentedRun(SegmentAwareAttention("sdpa"), inputs, plan, KVStore(), 0, seq_dim=2).run(grad_out)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(out, ref, "documents negative control")


def test_bind_documents_gives_unsplit_attention_the_same_semantics():
    ids = _ids(LAYOUTS["crossing"])
    inputs, grad_out = attention_inputs(2, 4, 2, 24, seed=72)
    ref, ref_grads = output_and_grads(lambda q, k, v: block_causal(q, k, v, ids), inputs, grad_out)
    attention = Checkpointed(SegmentAwareAttention("sdpa"))
    store = bind_documents(attention, ids)
    out, grads = output_and_grads(attention, inputs, grad_out)
    assert_close(out, ref, "bind_documents")
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, "bind_documents")
    assert store.peak_bytes == 0, "an unsplit run keeps no K/V"
    assert bind_documents(attention, None) is None
    causal, _ = output_and_grads(attention, inputs, grad_out)
    assert (causal - out).abs().max() > 1e-3


def test_bind_documents_rejects_bad_ids():
    attention = SegmentAwareAttention("sdpa")
    with pytest.raises(ValueError, match="non-decreasing"):
        bind_documents(attention, torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match="batch, seq_len"):
        bind_documents(attention, torch.zeros(3, dtype=torch.long))

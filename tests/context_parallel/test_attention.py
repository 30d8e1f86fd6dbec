# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware attention under context parallelism against unsplit attention, float64.

Two gloo ranks share every segment head-tail; each runs the segments forward in
order and backward last to first, as a Seq1F1B stage does, every backward on a
fresh thread, with and without checkpointing. Each rank's outputs and q/k/v
gradients must equal its share of the unsplit run's, and every rank issues one
all-gather and one reduce-scatter per segment, recomputed or not. Negative
controls: without the reduce-scatter's sum, with each piece's causal mask
aligned top-left, or with head-tail pieces of the whole sequence instead of
each segment (inputs and expected values cut alike), the gradients or outputs
differ.
"""

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention, SegmentAwareAttention
from torchtitan_seq1f1b.attention.segment_op import _pieces
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.context_parallel import ContextGroup, HeadTail
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.local_ranks import run_ranks
from torchtitan_seq1f1b.segmenting import SegmentPlan
from torchtitan_seq1f1b.stepping.segment_inputs import SegmentSplitter

BATCH, HEADS, HEAD_DIM = 2, 4, 8


def _unsplit(q, k, v, grad_out, ids, window_left):
    """Causal attention within documents (and the window) over the whole sequence:
    out and (dq, dk, dv)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    q_, k_, v_ = (x.transpose(1, 2) for x in leaves)
    positions = torch.arange(ids.shape[1])
    mask = (positions[None, :] <= positions[:, None]) & (ids[:, None, :] == ids[:, :, None])
    if window_left is not None:
        mask &= positions[None, :] >= positions[:, None] - window_left
    out = F.scaled_dot_product_attention(q_, k_, v_, mask[:, None], enable_gqa=True).transpose(1, 2)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


def _whole_sequence_split(self, tensor):
    """Head-tail over the whole sequence (as torchtitan's load balancer cuts it), that
    share then cut into segments of len_j / c: a rank's segment j holds other tokens than
    its head-tail pieces of segment j, which attention takes it to hold."""
    share = self.context.share(tensor, self.seq_dim)
    return share.split([n // self.context.degree for n in self.plan.lengths], self.seq_dim)


def _top_left_pieces(running, keys, window_left):
    """Each piece's queries aligned top-left against its keys: query i sees keys 0..i."""
    return [
        (rows, slice(span.start, span.start + rows.stop - rows.start), documents)
        for rows, span, documents in _pieces(running, keys, window_left)
    ]


BROKEN = {
    "no_reduction": mock.patch.object(
        ContextGroup, "reduce_scatter",
        lambda self, gk, gv: (self.layout.share(gk, 1), self.layout.share(gv, 1).clone()),
    ),
    "top_left_causal": mock.patch(
        "torchtitan_seq1f1b.attention.segment_op._pieces", _top_left_pieces
    ),
    "whole_sequence_head_tail": mock.patch.object(SegmentSplitter, "_split", _whole_sequence_split),
}


def _document_ids(plan: SegmentPlan, documents) -> torch.Tensor:
    """(BATCH, seq_len) ids: row r packs documents of lengths ``documents[r]`` (one
    document where None)."""
    rows = []
    for lengths in documents or [(plan.seq_len,)] * BATCH:
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def _segmented_share(
    rank, world_size, lengths, kv_heads, checkpoint=False, broken=None, documents=None,
    window_left=None,
):
    torch.manual_seed(0)
    plan = SegmentPlan.from_lengths(lengths)
    shape = (BATCH, plan.seq_len)
    q = torch.randn(*shape, HEADS, HEAD_DIM, dtype=torch.float64)
    k, v = (torch.randn(*shape, kv_heads, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn_like(q)
    ids = _document_ids(plan, documents)
    out, grads = _unsplit(q, k, v, grad_out, ids, window_left)
    microbatch = None if documents is None else MicrobatchDocuments(ids, plan)

    context = ContextGroup(HeadTail(world_size, rank), dist.group.WORLD)
    stack = contextlib.ExitStack()
    attention, store = SegmentAwareAttention("sdpa", window_left=window_left), KVStore()
    bind_attention(attention, store)

    splitter = SegmentSplitter(plan, seq_dim=1, context=context.layout)

    def share(x, segment):
        """This rank's share of ``segment`` of x, as the schedules cut their inputs."""
        return splitter.split_args((x,))[segment][0]

    calls = []
    for name in ("gather", "reduce_scatter"):
        method = getattr(ContextGroup, name)
        def counted(self, *args, method=method, name=name):
            calls.append(name)
            return method(self, *args)
        stack.enter_context(mock.patch.object(ContextGroup, name, counted))
    if broken is not None:
        stack.enter_context(BROKEN[broken])

    def attend(*qkv):
        if checkpoint:
            return torch.utils.checkpoint.checkpoint(attention.attend, *qkv, use_reentrant=False)
        return attention.attend(*qkv)

    units, leaves, outs = [], [], []
    for segment in range(plan.num_segments):
        units.append(RunningUnit(Unit(0, segment), plan, microbatch, context))
        leaves.append([share(x, segment).requires_grad_() for x in (q, k, v)])
        with store.running_unit(units[-1]):
            outs.append(attend(*leaves[-1]))
    with backward_on_fresh_thread():
        for segment in reversed(range(plan.num_segments)):
            with store.running_unit(units[segment]):
                outs[segment].backward(share(grad_out, segment))
    errors = []
    for segment in range(plan.num_segments):
        expected = [share(x, segment) for x in (out, *grads)]
        got = [outs[segment].detach(), *(x.grad for x in leaves[segment])]
        errors += [float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected)]
    stack.close()
    return max(errors), calls


# Every pair of lengths, heads and checkpointing, in four runs.
@pytest.mark.parametrize("lengths,kv_heads,checkpoint", [
    ((8,), 4, False), ((12, 4, 8), 2, True), ((4, 16, 4, 8), 4, True), ((4, 16, 4, 8), 2, False),
], ids=["8-mha-stored", "12,4,8-gqa-recomputed", "4,16,4,8-mha-recomputed", "4,16,4,8-gqa-stored"])
def test_context_parallel_segments_equal_unsplit_attention(lengths, kv_heads, checkpoint):
    results = run_ranks(_segmented_share, 2, lengths, kv_heads, checkpoint, timeout=120)
    for error, calls in results:
        assert error < 1e-12
        k = len(lengths)
        assert calls == ["gather"] * k + ["reduce_scatter"] * k


# Per row, document lengths: borders inside segments and inside head-tail pieces
# (pieces of 3, 1 and 4 tokens for the segments 12, 4 and 16), and a row of one document.
DOCUMENTS = {"crossing": ((5, 9, 2, 16), (32,)), "short": ((3, 3, 7, 1, 6, 12), (10, 22))}


@pytest.mark.parametrize("documents", list(DOCUMENTS))
def test_context_parallel_documents_equal_unsplit_attention(documents):
    for checkpoint in (False, True):
        results = run_ranks(
            _segmented_share, 2, (12, 4, 16), 2, checkpoint, None, DOCUMENTS[documents],
            timeout=120,
        )
        for error, _ in results:
            assert error < 1e-12


@pytest.mark.parametrize("documents", [None, "crossing"])
def test_context_parallel_sliding_windows_equal_unsplit_attention(documents):
    """Windows of 5 keys: they cross segment and piece borders."""
    results = run_ranks(
        _segmented_share, 2, (12, 4, 16), 2, True, None, DOCUMENTS.get(documents), 5,
        timeout=120,
    )
    for error, calls in results:
        assert error < 1e-12
        assert calls == ["gather"] * 3 + ["reduce_scatter"] * 3


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_context_parallelism_differs(broken):
    results = run_ranks(_segmented_share, 2, (12, 4, 8), 2, False, broken, timeout=120)
    assert max(error for error, _ in results) > 1e-3

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The per-microbatch K/V store: idempotent writes, freeing, ordering, byte accounting,
and the ops its gradient banking dispatches."""

import re

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchtitan_seq1f1b._torch_compat.dispatch_modes import TorchDispatchMode
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention, SegmentAwareAttention
from torchtitan_seq1f1b.kv_store import _PrefixBuffers, KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.harness import (
    assert_close,
    attention_inputs,
    compare_segmented,
    make_backend,
    PLANS,
    SegmentedRun,
)


def _segment_inputs(plan, segment, batch=2, n_heads=4, n_kv=2, seed=40):
    (q, k, v), _ = attention_inputs(batch, n_heads, n_kv, plan.seq_len, seed=seed)
    sl = plan.slices()[segment]
    return q[:, :, sl], k[:, :, sl], v[:, :, sl]


def test_store_writes_are_idempotent():
    """Re-running a segment's forward (activation-checkpoint recompute) changes
    nothing and allocates nothing."""
    plan = PLANS["5-3-4"]
    attn, store = SegmentAwareAttention("sdpa"), KVStore()
    bind_attention(attn, store)
    kv_bytes = 2 * 2 * plan.seq_len * 2 * 8 * 8  # k and v, (B, S, Hkv, D) float64
    for j in range(plan.num_segments):
        with store.running_unit(RunningUnit(Unit(0, j), plan)):
            first = attn(*_segment_inputs(plan, j))
            assert len(store) == 1 and store.nbytes == kv_bytes
            again = attn(*_segment_inputs(plan, j))
            assert len(store) == 1 and store.nbytes == kv_bytes
        assert torch.equal(first, again)
    assert store.peak_bytes == kv_bytes


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs):
        return checkpoint(self.inner, *inputs, use_reentrant=False)


@pytest.mark.parametrize("kind", ["sdpa", "flash"])
def test_segmented_with_activation_checkpointing(kind):
    """Non-reentrant checkpointing recomputes each segment's forward during its
    backward, after later segments already ran theirs."""
    fn = Checkpointed(SegmentAwareAttention(make_backend(kind)[0]))

    plan = PLANS["5-3-4"]
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=41)
    compare_segmented(fn, inputs, grad_out, plan, f"3 segmented {kind} + checkpoint")


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_sliding_window_layer_keeps_only_what_later_windows_read(checkpointed):
    """Segments 10/8/6, each query seeing 3 earlier keys: the store keeps each later
    segment's 3-key tail instead of the 24-token sequence, and banks 3 positions of
    gradient; recompute keeps no tail twice."""
    plan = SegmentPlan.from_lengths((10, 8, 6))
    layer = SegmentAwareAttention("sdpa", window_left=3)
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=42)
    fn = Checkpointed(layer) if checkpointed else layer
    store = compare_segmented(fn, inputs, grad_out, plan, "window of 3, 3 segments")
    position_bytes = 2 * 2 * 2 * 8 * 8  # k and v of one position: (B, Hkv, D) float64
    # Two tails, kept until the microbatch is freed, and from segment 2's backward on the bank.
    assert store.peak_bytes == 3 * 3 * position_bytes
    # Without a window: the sequence, then gradients banked for the first 18 positions.
    full = compare_segmented(SegmentAwareAttention("sdpa"), inputs, grad_out, plan, "no window")
    assert full.peak_bytes == (24 + 18) * position_bytes


def test_store_free_drops_only_that_microbatch():
    plan = PLANS["5-3-4"]
    attn, store = SegmentAwareAttention("sdpa"), KVStore()
    bind_attention(attn, store)
    for mb in (0, 1):
        with store.running_unit(RunningUnit(Unit(mb, 0), plan)):
            attn(*_segment_inputs(plan, 0, seed=40 + mb))
    assert len(store) == 2
    bytes_per_microbatch = store.nbytes // 2
    store.free(0)
    assert len(store) == 1 and store.nbytes == bytes_per_microbatch
    with store.running_unit(RunningUnit(Unit(0, 1), plan)), pytest.raises(RuntimeError, match="freed"):
        attn(*_segment_inputs(plan, 1))
    with store.running_unit(RunningUnit(Unit(1, 1), plan)):  # microbatch 1 is intact
        attn(*_segment_inputs(plan, 1, seed=41))
    store.free(1)
    assert len(store) == 0 and store.nbytes == 0
    assert store.peak_bytes == 2 * bytes_per_microbatch


def test_store_rejects_out_of_order_and_wrong_lengths():
    plan = PLANS["5-3-4"]
    attn, store = SegmentAwareAttention("sdpa"), KVStore()
    bind_attention(attn, store)
    with store.running_unit(RunningUnit(Unit(0, 1), plan)), pytest.raises(RuntimeError):
        attn(*_segment_inputs(plan, 1))
    assert len(store) == 0
    q, k, v = _segment_inputs(plan, 1)  # 3 tokens, but segment 0 has 5
    with store.running_unit(RunningUnit(Unit(0, 0), plan)), pytest.raises(
        ValueError, match=re.escape(str(plan))
    ):
        attn(q, k, v)
    assert len(store) == 0


def test_store_bytes_track_use_and_free():
    plan = PLANS["5-3-4"]
    attn, store = SegmentAwareAttention("sdpa"), KVStore()
    bind_attention(attn, store)
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=42)
    run = SegmentedRun(attn, inputs, plan, store, 0)
    for j in range(plan.num_segments):
        run.forward(j)
    kv_bytes = 2 * 2 * plan.seq_len * 2 * 8 * 8
    assert store.nbytes == kv_bytes
    run.backward(2, grad_out)
    # banked dK/dV cover the prefix before the last segment
    grad_bytes = 2 * 2 * plan.offsets[-1] * 2 * 8 * 8
    assert store.nbytes == kv_bytes + grad_bytes
    run.backward(1, grad_out), run.backward(0, grad_out)
    assert store.peak_bytes >= kv_bytes > 0
    store.free(0)
    assert store.nbytes == 0 and len(store) == 0


def test_store_peak_bytes_counts_gradient_buffers():
    plan = PLANS["5-3-4"]
    store = KVStore()
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=44)
    run = SegmentedRun(SegmentAwareAttention("sdpa"), inputs, plan, store, 0)
    for j in range(plan.num_segments):
        run.forward(j)
    run.backward(2, grad_out)
    assert store.peak_bytes >= store.nbytes


def test_enable_gqa_keyword_is_accepted():
    """Drop-in for torchtitan's ScaledDotProductAttentionWrapper call."""
    plan = PLANS["5-3-4"]
    (q, k, v), _ = attention_inputs(2, 4, 2, plan.seq_len, seed=45)
    attn, store = SegmentAwareAttention("sdpa"), KVStore()
    bind_attention(attn, store)
    ref = attn(q, k, v, enable_gqa=True)
    outs = []
    for j, sl in enumerate(plan.slices()):
        with store.running_unit(RunningUnit(Unit(0, j), plan)):
            outs.append(attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], enable_gqa=True))
    assert_close(torch.cat(outs, dim=2), ref, "3 segmented sdpa")


def test_attention_outside_unit_leaves_store_alone():
    plan = PLANS["5-3-4"]
    store = KVStore()
    (q, k, v), _ = attention_inputs(1, 4, 4, plan.seq_len, seed=43)
    out = SegmentAwareAttention("sdpa")(q, k, v)
    assert out.shape == q.shape and len(store) == 0


class _Ops(TorchDispatchMode):
    """Names of the non-view ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "key_starts,low",
    [((0, 0, 0), 0), ((0, 2, 5), 2)],  # causal; documents whose keys start at 0, 2 and 5
    ids=["causal", "documents"],
)
def test_banking_runs_two_ops_per_tensor_and_frees_after_segment_0(dtype, key_starts, low):
    """Per backward unit and layer, dK and dV each take one add into the bank (the prefix's
    gradients and the own positions' banked ones) and one copy back; the bank is opened
    without zero-filling what its first write covers, and dropped after segment 0."""
    lengths = (4, 3, 3)
    starts = (0, 4, 7)
    buffers = _PrefixBuffers(torch.zeros(2, 10, 2, 8, dtype=dtype), low, 10, starts[-1])
    gen = torch.Generator().manual_seed(7)
    grads = [
        [torch.randn(2, s + n - ks, 2, 8, generator=gen, dtype=torch.float64).to(dtype)
         for _ in "kv"]
        for ks, s, n in zip(key_starts, starts, lengths)
    ]
    ops, own = {}, {}
    for j in reversed(range(3)):
        grad_k, grad_v = (g.clone() for g in grads[j])
        with _Ops() as counted:
            own[j] = buffers.take_grads(
                key_starts[j], starts[j], starts[j] + lengths[j], grad_k, grad_v
            )
        ops[j] = counted.names
    first_write = ["empty", "empty", *["zero_"] * (key_starts[2] > low) * 2, "copy_", "copy_"]
    assert ops == {2: first_write, 1: ["add_", "copy_"] * 2, 0: ["add_", "copy_"] * 2}
    assert buffers.grad_k is None and buffers.grad_v is None
    for j in range(3):
        for t in range(2):  # k, v
            expected = []
            for pos in range(starts[j], starts[j] + lengths[j]):
                parts = [grads[i][t][:, pos - key_starts[i]] for i in reversed(range(j, 3))
                         if key_starts[i] <= pos and (i == j or low <= pos < starts[-1])]
                total = parts[0].float() if dtype == torch.bfloat16 else parts[0]
                for part in parts[1:]:
                    total = total + part
                expected.append(total.to(dtype))
            assert torch.equal(own[j][t], torch.stack(expected, dim=1)), (j, t)

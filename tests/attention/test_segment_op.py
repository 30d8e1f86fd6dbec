# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Compiled blocks run the exact CPU path as a registered op: exact, bounded compiles.

Eager blocks attend through autograd; "eager op" runs the op without compiling
(``torch.compiler.is_compiling`` patched), so a failure can be told from the compiler's.
"""

import pytest
import torch
import torch.nn as nn

from torchtitan_seq1f1b._torch_compat.compile_counts import compiled_graphs
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention, bind_documents, SegmentAwareAttention
from torchtitan_seq1f1b.attention.backend import KernelTarget
from torchtitan_seq1f1b.attention.choice import compile_problem
from torchtitan_seq1f1b.attention.exact import SDPABackend
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 8, 2


class _EagerSDPA(SDPABackend):
    """The exact CPU path through autograd, as before it ran as an op."""

    def runs_as_op(self, device_type):
        return False


class _Block(nn.Module):
    """x (batch, L, heads * head_dim) -> x + attention(x)."""

    def __init__(self, attention: SegmentAwareAttention):
        super().__init__()
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = nn.Linear(HEADS * HEAD_DIM, width, dtype=torch.float64)
        self.attention = attention

    def forward(self, x):
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
        return x + self.attention.attend(q, k, v).flatten(-2)


def _gradients(blocks, plan: SegmentPlan, microbatches: int, compile_blocks: bool):
    """Every parameter's and input's gradient after F of all units, then B last-to-first."""
    store = KVStore()
    for block in blocks:
        bind_attention(block, store)
    calls = [torch.compile(b, fullgraph=True) for b in blocks] if compile_blocks else blocks
    x = torch.randn(
        microbatches, BATCH, plan.seq_len, HEADS * HEAD_DIM, dtype=torch.float64,
        generator=torch.Generator().manual_seed(1),
    )
    outputs, inputs = {}, {}
    for i in range(microbatches):
        for j, (start, length) in enumerate(zip(plan.offsets, plan.lengths)):
            inputs[i, j] = x[i, :, start : start + length].clone().requires_grad_()
            with store.running_unit(RunningUnit(Unit(i, j), plan)):
                h = inputs[i, j]
                for call in calls:
                    h = call(h)
            outputs[i, j] = h
    for i in range(microbatches):
        for j in reversed(range(plan.num_segments)):
            with store.running_unit(RunningUnit(Unit(i, j), plan)):
                (outputs[i, j] ** 2).sum().backward()
    return [p.grad for b in blocks for p in b.parameters()] + [t.grad for t in inputs.values()]


@pytest.fixture(params=["eager op", "compiled"])
def compile_blocks(request, monkeypatch) -> bool:
    """Whether blocks compile; if not, the op runs eagerly."""
    if request.param == "eager op":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    return request.param == "compiled"


def test_the_op_equals_eager_segment_aware_attention(compile_blocks):
    plan = SegmentPlan.from_lengths((10, 8, 6))
    reference = [_Block(SegmentAwareAttention(_EagerSDPA())) for _ in range(3)]
    blocks = [_Block(SegmentAwareAttention("sdpa")) for _ in range(3)]
    for block, ref in zip(blocks, reference):
        block.load_state_dict(ref.state_dict())
    expected = _gradients(reference, plan, 2, compile_blocks=False)
    found = _gradients(blocks, plan, 2, compile_blocks)
    for a, b in zip(found, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "lengths, graphs", [((8, 8), 1), ((10, 8, 6), 2), ((7, 6, 5, 4, 3, 2, 1), 3)]
)
def test_compiled_blocks_compile_a_bounded_number_of_times(lengths, graphs):
    """Layers share one graph (their handles are inputs) and lengths turn dynamic after the
    first recompile: one graph for equal lengths, two for any others however many segments,
    microbatches and layers, and a third for a 1-token segment (dynamo specializes size 1)."""
    torch._dynamo.reset()
    before = compiled_graphs()
    blocks = [_Block(SegmentAwareAttention("sdpa")) for _ in range(4)]
    _gradients(blocks, SegmentPlan.from_lengths(lengths), 3, True)
    assert compiled_graphs() - before == graphs


def test_a_backward_sees_the_documents_its_forward_was_bound_to(compile_blocks):
    """As under torch's 1F1B: microbatch 1's forward rebinds the documents before
    microbatch 0's backward. Gradients equal one forward-backward per microbatch."""
    torch._dynamo.reset()
    before = compiled_graphs()
    ids = [torch.tensor([[0] * 5 + [1] * 7 + [2] * 4] * BATCH), torch.tensor([[0] * 9 + [1] * 7] * BATCH)]
    x = torch.randn(2, BATCH, 16, HEADS * HEAD_DIM, dtype=torch.float64)

    def run(block, interleaved):
        call = torch.compile(block, fullgraph=True) if compile_blocks and interleaved else block
        outputs = []
        for i in range(2):
            bind_documents(block, ids[i])
            outputs.append(call(x[i]))
            if not interleaved:
                (outputs[i] ** 2).sum().backward()
        if interleaved:
            for out in outputs:
                (out ** 2).sum().backward()
        return [p.grad for p in block.parameters()]

    reference = _Block(SegmentAwareAttention(_EagerSDPA()))
    block = _Block(SegmentAwareAttention("sdpa"))
    block.load_state_dict(reference.state_dict())
    for a, b in zip(run(block, interleaved=True), run(reference, interleaved=False)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if compile_blocks:
        assert compiled_graphs() - before == 1


def test_compile_is_refused_where_the_backend_does_not_run_as_the_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cpu = KernelTarget(torch.device("cpu"), torch.float32, 16)
    cuda = KernelTarget(torch.device("cuda"), torch.bfloat16, 128)
    assert compile_problem("auto", cpu) is None and compile_problem("sdpa", cpu) is None
    problem = compile_problem("sdpa", cuda)
    assert "attention_backend='sdpa' runs 'sdpa'" in problem and "registered op" in problem

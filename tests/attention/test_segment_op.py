# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Compiled blocks run attention as a registered op: exact, bounded compiles.

Eager blocks attend through autograd; "eager op" runs the op without compiling
(``torch.compiler.is_compiling`` patched), so a failure can be told from the compiler's.
The GPU kernels' forward and backward run on CPU kernels registered under
their ops' names (tests/registered_kernels.py).
"""

import pytest
import torch
import torch.nn as nn

from torchtitan_seq1f1b._torch_compat.compile_counts import compiled_graphs
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import (
    AttentionBackend,
    bind_attention,
    bind_documents,
    SegmentAwareAttention,
    TorchFlashBackend,
)
from torchtitan_seq1f1b.attention.exact import SDPABackend
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.registered_kernels import flash_attn_stand_in, FORWARD_CALLS, register_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 8, 2


class _EagerSDPA(SDPABackend):
    """The exact CPU path through autograd, as before it ran as an op."""

    def runs_as_op(self):
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


class _SDPAOn(SDPABackend):
    """The exact backend forced onto one of its kernels."""

    def __init__(self, kernel: str):
        self._kernel = kernel

    def device_kernel(self, q):
        return self._kernel


class _OnCPU(AttentionBackend):
    """A GPU backend's forward and backward on CPU: its device checks skipped."""

    def __init__(self, backend: AttentionBackend):
        self.backend, self.name = backend, backend.name

    def unmet_requirements(self, target):
        return []

    def runs_as_op(self):
        return True

    def forward(self, *args):
        return self.backend.forward(*args)

    def backward(self, *args):
        return self.backend.backward(*args)


def _document_ids(plan: SegmentPlan, microbatch: int) -> torch.Tensor:
    """(BATCH, seq_len): rows with documents crossing segments, a 1-token one, one long."""
    layouts = [(7, 1, 9, plan.seq_len - 17), (plan.seq_len - 3, 3)]
    rows = [layouts[(row + microbatch) % 2] for row in range(BATCH)]
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])


def _gradients(blocks, plan: SegmentPlan, microbatches: int, compile_blocks: bool, documents=False):
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
    docs = [
        MicrobatchDocuments(_document_ids(plan, i), plan) if documents else None
        for i in range(microbatches)
    ]
    for i in range(microbatches):
        for j, (start, length) in enumerate(zip(plan.offsets, plan.lengths)):
            inputs[i, j] = x[i, :, start : start + length].clone().requires_grad_()
            with store.running_unit(RunningUnit(Unit(i, j), plan, docs[i])):
                h = inputs[i, j]
                for call in calls:
                    h = call(h)
            outputs[i, j] = h
    for i in range(microbatches):
        for j in reversed(range(plan.num_segments)):
            with store.running_unit(RunningUnit(Unit(i, j), plan, docs[i])):
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


# Per kernel, the registered op its forward reaches (the math kernel is plain torch).
KERNEL_OPS = {
    "mem_efficient": "_efficient_attention_forward",
    "math": None,
    "varlen": "_scaled_dot_product_flash_attention",
    "flash": "_flash_attn_forward",
}
VARLEN_OPS = {"varlen": "_varlen_attn", "flash": "_flash_attn_varlen_forward"}


def _kernel_backend(kernel: str) -> AttentionBackend:
    register_cpu_kernels()
    if kernel in ("mem_efficient", "math"):
        return _OnCPU(_SDPAOn(kernel))
    return _OnCPU(TorchFlashBackend() if kernel == "varlen" else flash_attn_stand_in())


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("kernel", list(KERNEL_OPS))
def test_every_gpu_kernel_runs_as_the_op_exactly(kernel, documents, compile_blocks):
    """Explicit forward and backward of each GPU kernel: dense, per document
    (memory-efficient, math) or one packed varlen call (flash kernels)."""
    if compile_blocks and not documents:
        pytest.skip("compiled once per kernel, with documents")
    plan = SegmentPlan.from_lengths((10, 8, 6))
    reference = [_Block(SegmentAwareAttention(_EagerSDPA())) for _ in range(2)]
    blocks = [_Block(SegmentAwareAttention(_kernel_backend(kernel))) for _ in range(2)]
    for block, ref in zip(blocks, reference):
        block.load_state_dict(ref.state_dict())
    expected = _gradients(reference, plan, 2, compile_blocks=False, documents=documents)
    op = VARLEN_OPS.get(kernel) if documents else None
    op = op or KERNEL_OPS[kernel]
    calls = FORWARD_CALLS[op]
    found = _gradients(blocks, plan, 2, compile_blocks, documents=documents)
    for a, b in zip(found, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if op is not None:  # every layer of every unit reached the kernel
        assert FORWARD_CALLS[op] - calls >= len(blocks) * 2 * plan.num_segments


class _WithSinks(nn.Module):
    """q, k, v (batch, L, heads, head_dim) -> attention with per-head sinks, as gpt_oss's."""

    def __init__(self, backend: AttentionBackend, window_left: int | None = None):
        super().__init__()
        self.attention = SegmentAwareAttention(backend, window_left=window_left)
        gen = torch.Generator().manual_seed(30)
        self.sinks = nn.Parameter(torch.randn(HEADS, generator=gen, dtype=torch.float64))

    def forward(self, q, k, v):
        return self.attention.attend(q, k, v, 0.4, self.sinks)


def _attention_with_sink_key(q, k, v, sinks, ids, window_left=None):
    """Softmax over each query's visible keys (causal, own document, within
    ``window_left`` keys before it) and one more, zero-valued key of logit sinks[h]:
    q (B, L, H, D), k, v (B, L, Hkv, D), ids (B, L)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.4
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    if window_left is not None:
        causal &= torch.ones_like(causal).triu(-window_left)
    visible = causal & (ids[:, :, None] == ids[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("window_left", [None, 3, 9], ids=["full", "window3", "window9"])
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("kernel", ["cpu_flash", *KERNEL_OPS])
def test_sinks_and_windows_segmented_match_the_unsplit_formula(kernel, documents, window_left):
    """gpt_oss's attention: sinks, out * sigmoid(lse - sinks), with or without a sliding
    window, on every kernel: outputs and the gradients of q, k, v and the sinks, 3
    uneven segments against the unsplit formula. A window of 9 keys reaches back
    across two segment borders, one of 3 only into the segment before."""
    plan = SegmentPlan.from_lengths((10, 8, 6))
    backend = SDPABackend() if kernel == "cpu_flash" else _kernel_backend(kernel)
    layer = _WithSinks(backend, window_left)
    gen = torch.Generator().manual_seed(31)
    q, grad_out = (torch.randn(BATCH, 24, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in "qg")
    k, v = (torch.randn(BATCH, 24, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in "kv")
    ids = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5, [0] * 24]) if documents else torch.zeros(BATCH, 24, dtype=torch.long)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sinks = layer.sinks.detach().clone().requires_grad_()
    expected = _attention_with_sink_key(*leaves, sinks, ids, window_left)
    expected.backward(grad_out)
    if not documents:  # unsplit, outside any unit
        torch.testing.assert_close(layer(q, k, v), expected, rtol=1e-10, atol=1e-12)
    store = KVStore()
    out, grads = SegmentedRun(
        layer, [q, k, v], plan, store, document_ids=ids if documents else None
    ).run(grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for grad, leaf in zip(grads, leaves):
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.sinks.grad, sinks.grad, rtol=1e-10, atol=1e-12)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Segment-aware attention and the exact backend, in float64 on CPU.

References: a naive masked-softmax attention and CPU stand-ins of the GPU
kernels' documented contracts (tests/kernel_fakes.py). Segmented runs (forward
segment by segment, backward last-to-first, as Seq1F1B schedules them) must
reproduce the unsplit attention and its gradients; negative controls show the
comparison can fail. Real kernels run at the end when a GPU is present.
"""

import importlib.util

import pytest
import torch
import torch.nn as nn

from torchtitan_seq1f1b.attention import (
    FlashAttnBackend,
    resolve_backend,
    SDPABackend,
    SegmentAwareAttention,
    TorchFlashBackend,
    wrap_attention,
)
from torchtitan_seq1f1b.kv_store import _PrefixBuffers, KVStore
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.harness import (
    assert_close,
    attention_inputs,
    BACKEND_CASES,
    backend_inputs,
    compare_segmented,
    EXACT,
    F64,
    HEADS,
    make_backend,
    output_and_grads,
    PLANS,
    randn,
    rel_err,
    SegmentedRun,
    WORST,
)
from tests.kernel_fakes import naive_attention


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield
    for name, err in sorted(WORST.items()):
        print(f"\n[test_segment_aware] worst relative error, {name}: {err:.3e}")


@pytest.mark.parametrize("batch,q_len,k_len,n_heads,n_kv,scale", BACKEND_CASES)
def test_sdpa_backend_matches_naive(batch, q_len, k_len, n_heads, n_kv, scale):
    inputs, grad_out = backend_inputs(batch, q_len, k_len, n_heads, n_kv)
    out, grads = output_and_grads(lambda q, k, v: SDPABackend()(q, k, v, scale), inputs, grad_out)
    ref, ref_grads = output_and_grads(
        lambda q, k, v: naive_attention(q, k, v, scale), inputs, grad_out
    )
    assert out.shape == (batch, q_len, n_heads, 8)
    assert_close(out, ref, "1 sdpa vs naive", what="out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, "1 sdpa vs naive", what=f"d{name}")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_backend_low_precision_on_cpu(dtype, rtol):
    """The CPU low-precision SDPA paths (what "auto" picks on CPU) are aligned too."""
    for batch, q_len, k_len, n_heads, n_kv, scale in BACKEND_CASES:
        (q, k, v), _ = backend_inputs(batch, q_len, k_len, n_heads, n_kv, head_dim=64)
        out = SDPABackend()(q.to(dtype), k.to(dtype), v.to(dtype), scale)
        ref = naive_attention(*(x.to(dtype).double() for x in (q, k, v)), scale)
        assert_close(out.double(), ref, f"1 sdpa {dtype} vs naive", rtol)


def test_naive_reference_is_bottom_right():
    """Sanity of the reference itself: the last query sees every key, the first
    query of a 3-token segment after a 5-token prefix sees exactly 6 keys."""
    q = randn(1, 3, 1, 4, seed=5)
    k = torch.zeros(1, 8, 1, 4, dtype=F64)  # uniform scores: weights = 1 / visible
    v = torch.eye(8, dtype=F64).view(1, 8, 1, 8)  # output row t = weights of query t
    out = naive_attention(q, k, v, None)
    weights = out[0, :, 0]  # (3, 8): row t is the attention distribution of query t
    for t in range(3):
        visible = 5 + t + 1
        assert torch.allclose(weights[t, :visible], torch.full((visible,), 1 / visible, dtype=F64))
        assert (weights[t, visible:] == 0).all()



@pytest.mark.parametrize("kind", ["sdpa", "flash", "varlen", "cuda_exact"])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("batch", [1, 2])
def test_segmented_matches_unsplit(kind, plan_name, heads, batch):
    backend, fake = make_backend(kind)
    attn = SegmentAwareAttention(backend, scale=0.4 if batch == 2 else None)
    plan = PLANS[plan_name]
    n_heads, n_kv = HEADS[heads]
    inputs, grad_out = attention_inputs(batch, n_heads, n_kv, plan.seq_len, seed=20)
    compare_segmented(attn, inputs, grad_out, plan, f"3 segmented {kind}")
    if fake is not None:
        # segment j's kernel call: its own queries against the whole prefix
        seg_calls = fake.calls[1 : 1 + plan.num_segments]
        for call, length, end in zip(seg_calls, plan.lengths, plan.ends):
            assert (call["q_len"], call["k_len"]) == (length, end)
        if kind != "cuda_exact" or n_kv == n_heads:
            # every segment read the K/V buffers themselves: no prefix copy
            assert len({(c["k_storage"], c["v_storage"]) for c in seg_calls}) == 1


@pytest.mark.parametrize("kind", ["sdpa", "flash", "varlen", "cuda_exact"])
@pytest.mark.parametrize("v_head_dim", [5, 12], ids=["v-narrower", "v-wider"])
def test_value_head_dim_of_its_own_segmented_matches_unsplit(kind, v_head_dim):
    """MLA: V's head dim differs from q/k's (8); the kernels get it zero-padded."""
    attn = SegmentAwareAttention(make_backend(kind)[0])
    plan = PLANS["5-3-4"]
    (q, k, v), _ = attention_inputs(2, 4, 2, plan.seq_len, seed=21)
    v = randn(2, 2, plan.seq_len, v_head_dim, seed=22)
    grad_out = randn(2, 4, plan.seq_len, v_head_dim, seed=23)
    expected = naive_attention(*(x.transpose(1, 2) for x in (q, k, v)), None).transpose(1, 2)
    assert_close(attn(q, k, v), expected, f"3 segmented {kind}")
    compare_segmented(attn, [q, k, v], grad_out, plan, f"3 segmented {kind}")


class TwoLayers(nn.Module):
    """A stage with two attention layers: the second takes the first's output as q."""

    def __init__(self, attn_a, attn_b):
        super().__init__()
        self.attn_a, self.attn_b = attn_a, attn_b

    def forward(self, q, k, v, k2, v2):
        return self.attn_b(self.attn_a(q, k, v), k2, v2)


@pytest.mark.parametrize("kind", ["sdpa", "flash", "varlen", "cuda_exact"])
def test_interleaved_microbatches_two_layers(kind):
    """1F1B-style interleaving of two microbatches through two attention layers
    sharing one store: K/V and banked gradients stay per (layer, microbatch)."""
    plan = SegmentPlan.from_lengths((5, 3, 4))
    fn = TwoLayers(
        SegmentAwareAttention(make_backend(kind)[0]),
        SegmentAwareAttention(make_backend(kind)[0], scale=0.5),
    )
    batch, n_heads, seq = 2, 4, plan.seq_len
    micro = []
    for mb in range(2):
        seed = 100 + 10 * mb
        (q, k, v), grad_out = attention_inputs(batch, n_heads, 2, seq, seed=seed)
        k2, v2 = randn(batch, 1, seq, 8, seed=seed + 5), randn(batch, 1, seq, 8, seed=seed + 6)
        micro.append(((q, k, v, k2, v2), grad_out))

    store = KVStore()
    runs = [SegmentedRun(fn, inputs, plan, store, mb) for mb, (inputs, _) in enumerate(micro)]
    F = lambda mb, j: runs[mb].forward(j)  # noqa: E731
    B = lambda mb, j: runs[mb].backward(j, micro[mb][1])  # noqa: E731

    F(0, 0), F(0, 1), F(0, 2)
    F(1, 0)
    assert len(store) == 4  # 2 layers x 2 microbatches
    B(0, 2), F(1, 1), B(0, 1), F(1, 2), B(0, 0)
    store.free(0)
    assert len(store) == 2
    B(1, 2), B(1, 1), B(1, 0)
    store.free(1)
    assert len(store) == 0 and store.nbytes == 0

    for mb, (inputs, grad_out) in enumerate(micro):
        ref, ref_grads = output_and_grads(fn, inputs, grad_out)
        assert_close(runs[mb].output(), ref, f"3 interleaved {kind}", what=f"mb{mb} out")
        for i, (g, rg) in enumerate(zip(runs[mb].grads(), ref_grads)):
            assert_close(g, rg, f"3 interleaved {kind}", what=f"mb{mb} grad {i}")




def test_segmented_check_fails_without_gradient_routing(monkeypatch):
    def own_slice_only(self, key_start, start, end, grad_k, grad_v):
        return grad_k[:, start - key_start :], grad_v[:, start - key_start :]

    monkeypatch.setattr(_PrefixBuffers, "take_grads", own_slice_only)
    plan = PLANS["5-3-4"]
    inputs, grad_out = attention_inputs(2, 4, 2, plan.seq_len, seed=30)
    attn = SegmentAwareAttention("sdpa")
    ref, ref_grads = output_and_grads(attn, inputs, grad_out)
    out, grads = SegmentedRun(attn, inputs, plan, KVStore(), 0).run(grad_out)
    # forward and dq do not depend on the routing ...
    assert rel_err(out, ref) <= EXACT and rel_err(grads[0], ref_grads[0]) <= EXACT
    # ... but dK/dV of earlier segments lose what later segments sent back
    errors = [rel_err(grads[i], ref_grads[i]) for i in (1, 2)]
    WORST["4 negative control (dk, dv) min"] = min(errors)
    assert min(errors) > 1e-3, errors
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(grads[1], ref_grads[1], "4 negative control")


class TopLeftSDPA(SDPABackend):
    """A plausible bug: SDPA's is_causal (top-left aligned) with Lq < Lk."""

    def runs_as_op(self):
        return False  # the bug is in __call__

    def __call__(self, q, k, v, scale, documents=None):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)


def test_segmented_check_fails_with_top_left_mask():
    plan = PLANS["5-3-4"]
    inputs, grad_out = attention_inputs(1, 4, 4, plan.seq_len, seed=31)
    attn = SegmentAwareAttention(TopLeftSDPA())
    ref, _ = output_and_grads(attn, inputs, grad_out)  # unsplit: Lq == Lk, correct
    out, _ = SegmentedRun(attn, inputs, plan, KVStore(), 0).run(grad_out)
    assert rel_err(out, ref) > 1e-3




def test_auto_backend_on_cpu_is_exact_sdpa():
    for dtype in (F64, torch.float32, torch.bfloat16):
        q = randn(2, 3, 4, 8, seed=50, dtype=dtype)
        k, v = randn(2, 9, 2, 8, seed=51, dtype=dtype), randn(2, 9, 2, 8, seed=52, dtype=dtype)
        auto = resolve_backend("auto")
        assert auto.supports(q)
        assert torch.equal(auto(q, k, v, 0.3), SDPABackend()(q, k, v, 0.3))
    (q, k, v), _ = attention_inputs(1, 4, 2, 12, seed=53)
    assert torch.equal(SegmentAwareAttention("auto")(q, k, v), SegmentAwareAttention("sdpa")(q, k, v))


def test_resolve_backend_names():
    assert isinstance(resolve_backend("sdpa"), SDPABackend)
    with pytest.raises(ValueError, match="attention_backend='nope'"):
        resolve_backend("nope")
    with pytest.raises(ValueError, match="attention_backend"):
        SegmentAwareAttention("nope")


class _Inner(nn.Module):
    def forward(self, q, k, v):
        raise AssertionError("should have been replaced")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner_attention = _Inner()
        self.proj = nn.Linear(8, 8)


def test_wrap_attention_replaces_matching_modules():
    model = nn.Sequential(_Block(), _Block(), nn.Linear(8, 8))
    count = wrap_attention(model, lambda name, m: isinstance(m, _Inner), backend="sdpa")
    assert count == 2
    wrapped = [model[i].inner_attention for i in (0, 1)]
    assert all(isinstance(w, SegmentAwareAttention) for w in wrapped)
    assert all(isinstance(w.backend, SDPABackend) for w in wrapped)
    assert wrapped[0] is not wrapped[1]
    assert isinstance(model[0].proj, nn.Linear) and isinstance(model[2], nn.Linear)
    assert not any(isinstance(m, _Inner) for m in model.modules())
    assert wrap_attention(model, lambda name, m: isinstance(m, _Inner)) == 0
    (q, k, v), _ = attention_inputs(1, 4, 2, 6, seed=55)
    assert_close(
        wrapped[0](q, k, v),
        naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)
        .transpose(1, 2),
        "6 wrapped vs naive",
    )


def test_wrap_attention_by_name():
    model = nn.Sequential(_Block(), _Block())
    count = wrap_attention(model, lambda name, m: name == "1.inner_attention", backend="sdpa")
    assert count == 1
    assert isinstance(model[0].inner_attention, _Inner)
    assert isinstance(model[1].inner_attention, SegmentAwareAttention)



_HAS_CUDA = torch.cuda.is_available()
_HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
_HAS_SM80 = _HAS_CUDA and torch.cuda.get_device_capability() >= (8, 0)


def _assert_bf16_close(actual, expected, what):
    """bf16 tolerance: 2e-2 of the reference's magnitude (gradients sum many terms)."""
    atol = 2e-2 * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, rtol=2e-2, atol=atol, msg=what)


def _gpu_segmented_check(backend, device="cuda", dtype=torch.bfloat16):
    """Real kernel in bf16, segmented, vs unsplit fp32 SDPA on the same bf16 inputs."""
    plan = SegmentPlan.from_lengths((128, 64, 64))
    batch, n_heads, n_kv, head_dim = 2, 8, 2, 64

    def cast(x):
        return x.to(device=device, dtype=dtype)

    (q, k, v), grad_out = attention_inputs(batch, n_heads, n_kv, plan.seq_len, head_dim, seed=60)
    inputs, grad_out = [cast(x) for x in (q, k, v)], cast(grad_out)

    # kernel level: a 64-token segment against its 192-token prefix
    bq = cast(randn(batch, 64, n_heads, head_dim, seed=61))
    bk = cast(randn(batch, 192, n_kv, head_dim, seed=62))
    bv = cast(randn(batch, 192, n_kv, head_dim, seed=63))
    expected = naive_attention(bq.double(), bk.double(), bv.double(), None)
    _assert_bf16_close(backend(bq, bk, bv, None), expected, "kernel output")

    ref, ref_grads = output_and_grads(
        SegmentAwareAttention("sdpa"), [x.double() for x in inputs], grad_out.double()
    )
    out, grads = SegmentedRun(SegmentAwareAttention(backend), inputs, plan, KVStore(), 0).run(
        grad_out
    )
    assert out.dtype == dtype
    _assert_bf16_close(out, ref, "segmented output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        _assert_bf16_close(g, rg, f"segmented d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(_HAS_CUDA and not _HAS_SM80, reason="hardware: FlashAttention 2 needs sm80+")
@pytest.mark.skipif(not _HAS_FLASH, reason="needs flash_attn (pip install '.[flash]')")
def test_gpu_flash_segmented_matches_sdpa():
    _gpu_segmented_check(FlashAttnBackend())


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(_HAS_CUDA and not _HAS_SM80, reason="hardware: FlashAttention 2 needs sm80+")
def test_gpu_torch_flash_segmented_matches_sdpa():
    _gpu_segmented_check(TorchFlashBackend())


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")
def test_gpu_mask_free_exact_segmented_matches_sdpa():
    """The exact path on CUDA: memory-efficient kernel, bottom-right mask built in."""
    _gpu_segmented_check(SDPABackend())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The GPU kernel adapters on CPU, and which kernel runs where.

The adapters for flash-attn, torch's flash kernel and the mask-free exact
CUDA path run here through stand-ins that enforce each kernel's documented
contract (tests/kernel_fakes.py) and must equal the exact path in float64.
Kernel choice is checked against a mocked CUDA device: ``auto`` must never
pick a kernel whose requirements (compute capability, dtype, head_dim) the
device or job does not meet, and a forced backend must fail naming them.
"""

import logging

import pytest
import torch

from torchtitan_seq1f1b.attention import (
    check_backend,
    FlashAttnBackend,
    KernelTarget,
    SDPABackend,
    TorchFlashBackend,
)
from torchtitan_seq1f1b.attention.choice import _auto_choice
from torchtitan_seq1f1b.attention.cuda_mem_efficient import mem_efficient_requirements
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.kernel_fakes import (
    FakeEfficientAttentionOps,
    FakeFlashAttnFunc,
    FakeTorchFlashOps,
    FakeTorchVarlenAttn,
    naive_attention,
    stand_in_backend,
)
from tests.harness import assert_close, BACKEND_CASES, backend_inputs, output_and_grads, randn

CUDA = torch.device("cuda", 0)


# ---- adapters against the exact path -------------------------------------------


@pytest.mark.parametrize("kind", ["flash", "varlen", "cuda_exact"])
@pytest.mark.parametrize("batch,q_len,k_len,n_heads,n_kv,scale", BACKEND_CASES)
def test_adapter_matches_exact_path(kind, batch, q_len, k_len, n_heads, n_kv, scale):
    backend, fake = stand_in_backend(kind)
    inputs, grad_out = backend_inputs(batch, q_len, k_len, n_heads, n_kv, seed=10)
    out, grads = output_and_grads(lambda q, k, v: backend(q, k, v, scale), inputs, grad_out)
    ref, ref_grads = output_and_grads(
        lambda q, k, v: SDPABackend()(q, k, v, scale), inputs, grad_out
    )
    assert out.shape == (batch, q_len, n_heads, 8)
    assert_close(out, ref, f"{kind} adapter vs sdpa", what="out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, f"{kind} adapter vs sdpa", what=f"d{name}")
    (call,) = fake.calls
    assert (call["q_len"], call["k_len"], call["scale"]) == (q_len, k_len, scale)


@pytest.mark.parametrize("kind", ["flash", "varlen", "cuda_exact"])
def test_batch_strided_prefix_reaches_the_kernel_uncopied(kind):
    """A prefix view of the K/V buffers (batch-strided for batch > 1) is what
    the kernel gets. The mask-free exact path (our own autograd Function; the
    others' saving is the real kernels' business) saves q, the output, the
    logsumexp and those views: nothing of size Lq x Lk."""
    backend, fake = stand_in_backend(kind)
    batch, seq_len, end, q_len, n_heads = 2, 16, 11, 4, 4
    buffers = torch.randn(2, batch, seq_len, n_heads, 8, dtype=torch.float64)
    k, v = buffers[0, :, :end], buffers[1, :, :end]
    q = torch.randn(batch, q_len, n_heads, 8, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = backend(q, k, v, None)
    (call,) = fake.calls
    assert call["k_storage"] == call["v_storage"] == buffers.untyped_storage().data_ptr()
    if kind == "cuda_exact":
        inputs = {q.untyped_storage().data_ptr(), call["k_storage"]}
        fresh = sum(t.nbytes for t in saved if t.untyped_storage().data_ptr() not in inputs)
        logsumexp_bytes = batch * n_heads * q_len * 8
        assert fresh <= out.nbytes + logsumexp_bytes + 2 * 8  # output, lse, rng seed/offset
    torch.testing.assert_close(out, naive_attention(q, k, v, None))


def test_mask_free_exact_path_saves_no_mask():
    """Bytes saved for backward per attention call: the dense-mask SDPA path
    keeps an (Lq, Lk) mask on top of what the mask-free path keeps."""
    backend, _ = stand_in_backend("cuda_exact")
    q_len, k_len = 24, 96
    (q, k, v), _ = backend_inputs(1, q_len, k_len, 4, 2)
    q.requires_grad_()

    def new_bytes_saved(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
        fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in saved if t.untyped_storage().data_ptr() not in inputs}
        return sum(fresh.values()), saved

    mask_free, saved = new_bytes_saved(lambda: backend(q, k, v, None))
    assert not any(t.shape[-2:] == (q_len, k_len) for t in saved)
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    dense, _ = new_bytes_saved(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
    )
    assert dense >= mask_free + mask.nbytes


def test_stand_ins_enforce_their_contracts():
    """Passing through a stand-in means the kernel was called the way it must be."""
    q, k, v = (torch.randn(1, 6, 4, 8, dtype=torch.float64) for _ in range(3))
    with pytest.raises(AssertionError, match="causal"):
        FakeFlashAttnFunc()(q, k, v)
    with pytest.raises(AssertionError, match="contiguous last dim"):
        FakeFlashAttnFunc()(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, causal=True)
    with pytest.raises(AssertionError):  # top-left causal would be a different op
        FakeTorchFlashOps()._scaled_dot_product_flash_attention(q, k, v, is_causal=False)
    ops = FakeEfficientAttentionOps()
    with pytest.raises(AssertionError, match="custom_mask_type 2"):
        ops._efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, 1)
    with pytest.raises(AssertionError, match="equal head counts"):
        ops._efficient_attention_forward(q, k[:, :, :2], v[:, :, :2], None, None, None, None, None, 0.0, 2)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    packed = q[0], k[0], v[0]
    FakeTorchVarlenAttn()(*packed, cu, cu.clone(), 6, 6, window_size=(-1, 0))
    with pytest.raises(AssertionError, match="distinct tensors"):  # cuDNN would align top-left
        FakeTorchVarlenAttn()(*packed, cu, cu, 6, 6, window_size=(-1, 0))


# ---- which kernel runs where -------------------------------------------------------


@pytest.fixture
def capability(monkeypatch):
    """Set the mocked CUDA device's compute capability (auto's per-process
    choice is forgotten around each test: a real device does not change)."""
    _auto_choice.cache_clear()
    state = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["value"])

    def set_capability(major, minor):
        state["value"] = (major, minor)

    yield set_capability
    _auto_choice.cache_clear()


@pytest.fixture
def flash_attn_installed(monkeypatch):
    def set_installed(installed: bool):
        monkeypatch.setattr(FlashAttnBackend, "installed", classmethod(lambda cls: installed))

    set_installed(False)
    return set_installed


# (capability, dtype, head_dim, flash-attn installed) -> backend auto picks
AUTO_CHOICES = [
    ((9, 0), torch.bfloat16, 128, True, "flash"),
    ((9, 0), torch.bfloat16, 128, False, "varlen"),
    ((8, 0), torch.float16, 64, False, "varlen"),
    ((8, 6), torch.bfloat16, 256, True, "flash"),
    ((8, 6), torch.bfloat16, 256, False, "sdpa"),  # torch's flash backward: <= 192 on sm86
    ((8, 7), torch.bfloat16, 256, False, "sdpa"),  # ... sm86-89 and sm120/121
    ((12, 0), torch.bfloat16, 256, False, "sdpa"),
    ((12, 1), torch.bfloat16, 224, False, "sdpa"),
    ((12, 0), torch.bfloat16, 192, False, "varlen"),
    ((10, 0), torch.bfloat16, 256, False, "varlen"),
    ((8, 0), torch.bfloat16, 320, True, "sdpa"),  # head_dim > 256
    ((8, 0), torch.bfloat16, 100, True, "sdpa"),  # not a multiple of 8: padding would copy
    ((7, 5), torch.float16, 128, True, "sdpa"),  # Turing: no FlashAttention 2
    ((9, 0), torch.float32, 128, True, "sdpa"),  # fp32 training
]


@pytest.mark.parametrize("cap,dtype,head_dim,installed,expected", AUTO_CHOICES)
def test_auto_picks_a_kernel_that_can_run(
    capability, flash_attn_installed, caplog, cap, dtype, head_dim, installed, expected
):
    capability(*cap)
    flash_attn_installed(installed)
    target = KernelTarget(CUDA, dtype, head_dim)
    with caplog.at_level(logging.INFO, logger="torchtitan_seq1f1b.attention.choice"):
        chosen = check_backend("auto", target)
        assert check_backend("auto", target) is chosen  # decided once
    assert chosen.name == expected
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"uses {expected!r}" in line and f"sm{cap[0]}{cap[1]}" in line
    if expected == "sdpa":
        assert "'varlen' needs" in line  # says why the faster kernels were passed over


def test_auto_on_cpu_is_the_exact_path():
    assert check_backend("auto", KernelTarget(torch.device("cpu"), torch.bfloat16, 64)).name == "sdpa"


@pytest.mark.parametrize(
    "name,cap,dtype,head_dim,installed,needs",
    [
        ("flash", None, torch.bfloat16, 64, False, "a CUDA device (this runs on cpu)"),
        ("varlen", None, torch.float32, 64, False, "a CUDA device (this runs on cpu)"),
        ("flash", (8, 0), torch.bfloat16, 64, False, "pip install 'torchtitan-seq1f1b[flash]'"),
        ("flash", (7, 5), torch.float16, 64, True, "compute capability >= 8.0"),
        ("varlen", (9, 0), torch.float32, 64, False, "fp16 or bf16 activations (found torch.float32)"),
        ("varlen", (8, 9), torch.bfloat16, 256, False, "head_dim <= 192 on sm86-89 and sm120"),
        ("varlen", (9, 0), torch.bfloat16, 96 + 4, False, "head_dim a multiple of 8 and <= 256"),
    ],
)
def test_forced_backend_names_what_it_needs(
    capability, flash_attn_installed, name, cap, dtype, head_dim, installed, needs
):
    flash_attn_installed(installed)
    device = torch.device("cpu")
    if cap is not None:
        capability(*cap)
        device = CUDA
    with pytest.raises(ValueError) as info:
        check_backend(name, KernelTarget(device, dtype, head_dim))
    message = str(info.value)
    assert f"attention_backend={name!r} cannot run" in message and needs in message
    assert "attention_backend='auto'" in message
    if cap is None:  # installing flash-attn would not help on a CPU
        assert "pip install" not in message


def test_rocm_does_not_take_the_memory_efficient_path(capability, monkeypatch):
    """ROCm's memory-efficient backward rejects the bottom-right mask type (2)."""
    target = KernelTarget(CUDA, torch.bfloat16, 128)
    assert mem_efficient_requirements(target) == []
    monkeypatch.setattr(torch.version, "hip", "6.4")
    (unmet,) = mem_efficient_requirements(target)
    assert "not ROCm" in unmet


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "varlen"])
def test_flash_attn_is_told_torchs_deterministic_setting(deterministic, documents):
    backend, dense = stand_in_backend("flash")
    fake = backend.varlen_fake if documents else dense
    # segment 1 (positions 6-9) of a row whose second document starts at 3
    layout = MicrobatchDocuments(torch.tensor([[0] * 3 + [1] * 7]), SegmentPlan.from_lengths((6, 4)))
    layout = layout.segment(1) if documents else None
    keys = 7 if documents else 10
    q, k, v = (randn(1, n, 2, 8, seed=n + i) for i, n in enumerate((4, keys, keys)))
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        backend(q, k, v, None, layout)
    finally:
        torch.use_deterministic_algorithms(saved)
    assert fake.calls and all(c["deterministic"] is deterministic for c in fake.calls)


def test_forced_backend_that_runs_is_returned(capability, flash_attn_installed):
    capability(8, 0)
    flash_attn_installed(True)
    target = KernelTarget(CUDA, torch.bfloat16, 128)
    assert isinstance(check_backend("flash", target), FlashAttnBackend)
    assert isinstance(check_backend("varlen", target), TorchFlashBackend)
    assert isinstance(check_backend("sdpa", target), SDPABackend)


def test_segment_aware_attention_refuses_a_kernel_that_cannot_run():
    from torchtitan_seq1f1b.attention import SegmentAwareAttention

    q = k = v = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="attention_backend='varlen' cannot run on cpu"):
        SegmentAwareAttention("varlen")(q, k, v)

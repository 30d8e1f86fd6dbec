# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The fla backend of the recurrence: its argument marshalling on CPU through a fake
fla (cu_seqlens, initial and final states, dht and dh0 per sequence) against the exact
path, the automatic choice, the check's GatedDeltaNet row (its skips, and run through the
fake), and on CUDA fla's real kernel and that row in bf16 against float64."""

import inspect

import pytest
import torch

from torchtitan_seq1f1b.attention import KernelTarget
from torchtitan_seq1f1b.check import gated_delta_net
from torchtitan_seq1f1b.check.kernels import kernel_tasks
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.linear_attention import _fla, GatedDeltaNetConfig, ops
from torchtitan_seq1f1b.linear_attention import backends
from torchtitan_seq1f1b.linear_attention.backends import (
    check_recurrence_backend,
    ExactRecurrence,
    FlaRecurrence,
    recurrence_layout,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests.kernel_fakes import FakeFla
from tests.linear_attention.gdn_runs import (
    compare,
    document_ids,
    DOCUMENTS,
    layer_inputs,
    make_layer,
    PLANS,
    report_worst,
    segmented,
    unsplit,
)

FAMILIES = ["fla adapter (fake fla) vs exact"]
CPU_F64 = KernelTarget(torch.device("cpu"), torch.float64, 3)


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    report_worst(FAMILIES)


def _row_starts(lengths_per_row=DOCUMENTS) -> list[list[int]]:
    starts = []
    for lengths in lengths_per_row:
        row = [0]
        for n in lengths[:-1]:
            row.append(row[-1] + n)
        starts.append(row)
    return starts


def _expected_cu_seqlens(plan: SegmentPlan, j: int) -> list[int] | None:
    """Per row, a sequence from the segment's start and from every document start inside it."""
    start, end = plan.offsets[j], plan.ends[j]
    rows = [[s for s in row if start < s < end] for row in _row_starts()]
    if not any(rows):
        return None
    length, cu = end - start, []
    for r, inside in enumerate(rows):
        cu += [r * length] + [r * length + s - start for s in inside]
    return cu + [len(rows) * length]


@pytest.mark.parametrize("plan", ["k2", "k4", "k4-short-first"])
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_fla_adapter_equals_the_exact_path(plan, documents, monkeypatch):
    """Segmented through the fake fla equals the exact layer unsplit, and the calls carry
    the right cu_seqlens, states, dht and dh0: a row's first sequence starts from the
    previous segment's final state of that row, unless its document starts at the cut."""
    plan, ids, fake = PLANS[plan], (document_ids() if documents else None), FakeFla()
    monkeypatch.setattr(ops, "_backend", lambda handle, q: ExactRecurrence())
    layer = make_layer()
    x, grad_out = layer_inputs()
    expected = unsplit(layer, x, grad_out, ids)
    monkeypatch.setattr(ops, "_backend", lambda handle, q: FlaRecurrence(kernels=fake))
    compare(segmented(layer, x, grad_out, plan, ids), expected, FAMILIES[0])

    k = plan.num_segments
    forwards = [c for c in fake.calls if c["kind"] == "forward"][:k]
    backwards = [c for c in fake.calls if c["kind"] == "backward"]
    assert [c["cu_seqlens"] for c in forwards] == [
        _expected_cu_seqlens(plan, j) if documents else None for j in range(k)
    ]
    assert [c["cu_seqlens"] for c in backwards] == [c["cu_seqlens"] for c in reversed(forwards)]
    starts = _row_starts() if documents else [[0]] * 3

    def firsts_lasts(call):
        cu = call["cu_seqlens"]
        if cu is None:
            return list(range(3)), list(range(3))
        length = cu[-1] // 3
        first = [cu.index(r * length) for r in range(3)]
        return first, [f - 1 for f in first[1:]] + [len(cu) - 2]

    assert forwards[0]["initial_state"] is None and backwards[-1]["dh0"] is None
    assert backwards[0]["dht"] is None
    for j in range(1, k):
        call, before = forwards[j], forwards[j - 1]
        first, _ = firsts_lasts(call)
        _, last_before = firsts_lasts(before)
        initial = call["initial_state"]
        for r in range(3):
            continues = plan.offsets[j] not in starts[r]
            want = before["final_state"][last_before[r]] if continues else 0 * initial[0]
            torch.testing.assert_close(initial[first[r]], want, rtol=0, atol=0)
        others = sorted(set(range(initial.shape[0])) - set(first))
        assert not initial[others].any(), "sequences after a row's first start at zero"
        # Backward of segment j - 1 gets, per row, segment j's dh0 of that row (0 if reset).
        after, grad_call = backwards[k - j], backwards[k - 1 - j]
        dht = after["dht"]
        _, last = firsts_lasts(after)
        for r in range(3):
            continues = plan.offsets[j] not in starts[r]
            want = grad_call["dh0"][first[r]] if continues else 0 * dht[0]
            torch.testing.assert_close(dht[last[r]], want.to(dht.dtype), rtol=1e-12, atol=0)
        assert not dht[sorted(set(range(dht.shape[0])) - set(last))].any()


class _WrongInitialState(FakeFla):
    """Drops the carried state: every segment starts from zero."""

    def chunk_gated_delta_rule(self, *args, initial_state=None, **kwargs):
        return super().chunk_gated_delta_rule(*args, initial_state=None, **kwargs)


class _NoDh0(FakeFla):
    """Hands back a zero initial-state gradient."""

    def chunk_gated_delta_rule_backward(self, *args, **kwargs):
        *grads, dh0 = super().chunk_gated_delta_rule_backward(*args, **kwargs)
        return (*grads, None if dh0 is None else torch.zeros_like(dh0))


@pytest.mark.parametrize("fake", [_WrongInitialState, _NoDh0])
def test_a_fake_that_drops_the_state_or_its_gradient_fails(fake, monkeypatch):
    ids = document_ids()
    monkeypatch.setattr(ops, "_backend", lambda handle, q: ExactRecurrence())
    layer = make_layer()
    x, grad_out = layer_inputs()
    expected = unsplit(layer, x, grad_out, ids)
    monkeypatch.setattr(ops, "_backend", lambda handle, q: FlaRecurrence(kernels=fake()))
    with pytest.raises(AssertionError, match="relative error"):
        compare(segmented(layer, x, grad_out, PLANS["k4"], ids), expected, "negative control")


def test_layout_is_built_once_per_segment():
    """Segment [5, 7) of DOCUMENTS: rows 0 and 2 have a document starting at 6."""
    plan = PLANS["k4"]
    documents = MicrobatchDocuments(document_ids(), plan).segment(2)
    layout = recurrence_layout(documents, torch.device("cpu"), FakeFla)
    assert layout.cu_seqlens.tolist() == [0, 1, 2, 4, 5, 6] == _expected_cu_seqlens(plan, 2)
    assert layout.first.tolist() == [0, 2, 3] and layout.last.tolist() == [1, 2, 4]
    assert recurrence_layout(documents, torch.device("cpu"), FakeFla) is layout
    assert recurrence_layout(MicrobatchDocuments(document_ids(), plan).segment(1), "cpu") is None


def test_auto_picks_exact_on_cpu_and_forced_fla_says_why_not():
    assert isinstance(check_recurrence_backend("auto", CPU_F64), ExactRecurrence)
    with pytest.raises(ValueError, match="'fla' cannot run on cpu.*a CUDA device"):
        check_recurrence_backend("fla", CPU_F64)
    cuda = KernelTarget(torch.device("cuda"), torch.float32, 512)
    unmet = FlaRecurrence(kernels=FakeFla()).unmet_requirements(cuda)
    assert unmet == ["fp16 or bf16 activations (found torch.float32)", "key head dim <= 256 (found 512)"]
    with pytest.raises(ValueError, match="recurrence_backend='flash' is unknown"):
        GatedDeltaNetConfig(4, 1, 1, 2, 2, recurrence_backend="flash")


def test_forced_fla_layer_on_cpu_raises():
    layer = make_layer()
    object.__setattr__(layer, "config", GatedDeltaNetConfig(**{
        **layer.config.__dict__, "recurrence_backend": "fla"}))
    x, _ = layer_inputs()
    with pytest.raises(ValueError, match="recurrence_backend='fla' cannot run"):
        layer(x)


def test_fla_versions_outside_the_tested_range_are_refused(monkeypatch):
    monkeypatch.setattr(_fla, "_version", lambda: (0, 7, 0))
    assert "found 0.7.0" in _fla.unmet()[0] and "untested" in _fla.unmet()[0]
    monkeypatch.setattr(_fla, "_version", lambda: None)
    assert "installed" in _fla.unmet()[0]
    monkeypatch.setattr(_fla, "_version", lambda: _fla.TESTED[0])
    assert _fla.unmet() == []


def test_the_fake_has_fla_signatures():
    fake = FakeFla()
    ours = inspect.signature(_fla.chunk_gated_delta_rule_backward).parameters
    assert list(inspect.signature(fake.chunk_gated_delta_rule_backward).parameters) == list(ours)
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    public = inspect.signature(fla.chunk_gated_delta_rule).parameters
    assert list(inspect.signature(fake.chunk_gated_delta_rule).parameters) == list(public)
    chunk = pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    # The private functions _fla calls take the keywords it passes.
    assert {"chunk_indices", "chunk_size", "initial_state", "output_final_state"} <= set(
        inspect.signature(chunk.chunk_gated_delta_rule_fwd).parameters)
    assert {"A", "do", "dht", "chunk_indices", "chunk_size"} <= set(
        inspect.signature(chunk.chunk_gated_delta_rule_bwd).parameters)


def _stand_in(kernels):
    """The fla backend on ``kernels`` with its device checks skipped, as the check resolves it."""

    class StandInFla(FlaRecurrence):
        def __init__(self):
            super().__init__(kernels=kernels)

        def unmet_requirements(self, target):
            return []

    return StandInFla


@pytest.fixture
def fresh_backend_choice():
    check_recurrence_backend.cache_clear()
    yield
    check_recurrence_backend.cache_clear()


def test_check_row_is_listed_and_says_why_it_skips(monkeypatch):
    """Listed with the kernel rows; skipped on CPU for CUDA, on CUDA for fla-core."""
    cpu = torch.device("cpu")
    assert [task.names for task in kernel_tasks(cpu)][-1] == (gated_delta_net.ROW,)
    row = gated_delta_net.check_fla_layer(cpu)
    assert (row.status, row.reason) == ("skip", "needs a CUDA device (this runs on cpu)")
    # Only the requirements are read on a CUDA device that fla cannot use: nothing runs.
    monkeypatch.setattr(_fla, "_version", lambda: None)
    row = gated_delta_net.check_fla_layer(torch.device("cuda"))
    assert row.status == "skip"
    assert row.reason.startswith("needs fla-core >= 0.6.0, < 0.6.1 installed"), row
    monkeypatch.setattr(_fla, "_version", lambda: (0, 7, 0))
    row = gated_delta_net.check_fla_layer(torch.device("cuda"))
    assert row.status == "skip" and "found 0.7.0" in row.reason


@pytest.mark.parametrize("fake", [FakeFla, _WrongInitialState, _NoDh0])
def test_check_row_through_the_fake(fake, monkeypatch, fresh_backend_choice):
    """The row on CPU through the fake fla: passes, in varlen and batch mode and with
    carried states; fails when the fake drops the carried state or its gradient."""
    kernels = fake()
    monkeypatch.setitem(backends.RECURRENCE_BACKENDS, "fla", _stand_in(kernels))
    row = gated_delta_net.check_fla_layer(torch.device("cpu"))
    assert row.name == gated_delta_net.ROW and row.measured["bound"] == gated_delta_net.BOUND
    if fake is not FakeFla:
        assert row.status == "fail" and "> bound" in row.reason, row
        return
    assert row.status == "pass" and 0 < row.measured["error"] <= row.measured["bound"], row
    forwards = [c for c in kernels.calls if c["kind"] == "forward"]
    # Segment 0: batch mode, no state; 1: varlen (cuts 150 and 176 inside); 2: batch, carried.
    assert [c["cu_seqlens"] for c in forwards] == [None, [0, 54, 112, 192, 224, 336], None]
    assert forwards[0]["initial_state"] is None
    assert not forwards[1]["initial_state"][2].any(), "row 1's document starts at the cut"
    assert all(forwards[2]["initial_state"][r].any() for r in range(3)), "every row continues"


_HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(_HAS_CUDA and bool(_fla.unmet()), reason="needs fla-core (pip install fla-core)")
def test_gpu_fla_kernel_matches_the_exact_path_in_float64():
    """fla's kernel in bf16 (fp32 gates and states) against the exact path in float64 on
    the same rounded inputs: two rows of 200 tokens, documents crossing 64-token chunks,
    one row continuing a carried state, the other starting a document at the cut."""
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, key_dim, value_dim = 2, 200, 4, 64, 64

    def draw(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator).to("cuda", dtype)

    q, k = draw(batch, length, heads, key_dim), draw(batch, length, heads, key_dim)
    v = draw(batch, length, heads, value_dim)
    g = -torch.rand(batch, length, heads, generator=generator).cuda() * 0.1
    beta = torch.rand(batch, length, heads, generator=generator).to("cuda", torch.bfloat16)
    initial = draw(batch, heads, key_dim, value_dim, dtype=torch.float32)
    grad_o, grad_final = draw(batch, length, heads, value_dim), draw(
        batch, heads, key_dim, value_dim, dtype=torch.float32)
    plan = SegmentPlan.from_lengths((100, length, 100))
    ids = torch.tensor([[0] * 150 + [1] * 150 + [2] * 100, [0] * 100 + [1] * 70 + [2] * 230])
    documents = MicrobatchDocuments(ids.cuda(), plan).segment(1)
    positions = torch.arange(100, 300, device="cuda") - documents.microbatch.device_starts[:, 100:300]
    args = (q, k, v, g, beta, key_dim**-0.5, initial)
    o, final = FlaRecurrence().forward(*args, positions, documents)
    grads = FlaRecurrence().backward(grad_o, grad_final, *args, positions, documents)
    as64 = [x.double() for x in (q, k, v, g, beta)]
    exact = ExactRecurrence()
    o64, final64 = exact.forward(*as64, key_dim**-0.5, initial.double(), positions, documents)
    grads64 = exact.backward(
        grad_o.double(), grad_final.double(), *as64, key_dim**-0.5, initial.double(), positions,
        documents,
    )
    error, where = gated_delta_net.worst_error([("o", o, o64), ("final", final, final64), *[
        (n, getattr(grads, n), getattr(grads64, n))
        for n in ("q", "k", "v", "g", "beta", "initial_state")
    ]])
    assert error <= gated_delta_net.BOUND, f"{where}: norm-wise relative error {error:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(_HAS_CUDA and bool(_fla.unmet()), reason="needs fla-core (pip install fla-core)")
def test_gpu_check_row_runs_a_segmented_fla_layer_within_its_bound():
    """The check's ``kernel gdn-fla`` row on fla's real kernel: passes, never skips."""
    row = gated_delta_net.check_fla_layer(torch.device("cuda"))
    assert row.status == "pass", row

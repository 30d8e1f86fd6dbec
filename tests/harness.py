# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the tests share.

- attention checks: float64 inputs, relative errors (the worst per check family
  is kept in ``WORST`` for the modules to print), segmented-vs-unsplit runs;
- multi-process exactness: cases, the unsplit reference, pipelined runs
  (:mod:`torchtitan_seq1f1b.check.exactness`), optionally through a GPU
  kernel's CPU stand-in, and the gloo launcher;
- torchtitan jobs (:mod:`torchtitan_seq1f1b.check.titan_runs`), their ranks
  forked from the session's job server, and the comparison of two such runs.
"""

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from torchtitan_seq1f1b import kv_store
from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.attention import SDPABackend
from torchtitan_seq1f1b.check import exactness, segmented
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.exactness import reference, SCHEDULES
from torchtitan_seq1f1b.local_ranks import RankFailure, run_ranks
from torchtitan_seq1f1b.check import titan_runs
from torchtitan_seq1f1b.check.job_server import JobServer
from torchtitan_seq1f1b.check.titan_runs import (
    DEBUG_CONFIG,
    REPO,
    Run,
    RunFailed,
    TEST_ARGS,
    unpipelined_args,
)
from torchtitan_seq1f1b.integration import MAIN, titan_release
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b import schedules as schedule_module
from torchtitan_seq1f1b.segmenting import SegmentPlan

from tests import no_final_wait
from tests.kernel_fakes import stand_in_backend

__all__ = [
    "BACKEND_CASES",
    "BREAKS",
    "Case",
    "DEBUG_CONFIG",
    "EXACT",
    "F64",
    "HEADS",
    "PLANS",
    "REPO",
    "JOB_ROWS",
    "JOB_TOKENS",
    "JOB_TOKENS_OPTION",
    "RESUME_STEPS",
    "RankFailure",
    "Run",
    "RunFailed",
    "SCHEDULES",
    "SegmentedRun",
    "TEST_ARGS",
    "unpipelined_args",
    "TORCHTITAN_RTOL",
    "VALIDATION_DATA_ARGS",
    "WORST",
    "assert_close",
    "assert_same_training",
    "attention_inputs",
    "backend_inputs",
    "broken",
    "compare_segmented",
    "expected_kv_peak_bytes",
    "largest_difference",
    "make_backend",
    "output_and_grads",
    "pipelined",
    "pipelined_broken",
    "pipelined_cases",
    "randn",
    "reference",
    "rel_err",
    "run_ranks",
    "torchrun",
    "worst_relative_grad_error",
]

# The session's torchtitan jobs fork their ranks from preloaded servers
# (check/job_server.py); tests/check/test_job_server.py shows a job trains there
# as under torchrun.
JOB_SERVER = JobServer()


def torchrun(*args, launchers: tuple[str, ...] = (), **options) -> Run:
    """:func:`titan_runs.torchrun`, its ranks forked from the session's job server and
    its trainer without the final 2 s wait (:mod:`tests.no_final_wait`)."""
    return titan_runs.torchrun(
        *args, launchers=(no_final_wait.__name__, *launchers), server=JOB_SERVER, **options
    )

# Modules a torchtitan training process must not load: tools, checks, benchmarks.
NOT_FOR_TRAINING = (
    "torchtitan_seq1f1b.tools",
    "torchtitan_seq1f1b.check",
    "torchtitan_seq1f1b.local_ranks",
    "benchmarks",
    "matplotlib",
)


F64 = torch.float64
EXACT = 1e-12  # relative tolerance for float64 comparisons

# Worst relative error seen per check family; printed at module teardown (-s).
WORST: dict[str, float] = defaultdict(float)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are zero)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def assert_close(actual, expected, family: str, rtol: float = EXACT, what: str = ""):
    err = rel_err(actual.detach(), expected.detach())
    WORST[family] = max(WORST[family], err)
    assert err <= rtol, f"{family} {what}: relative error {err:.3e} > {rtol:.1e}"


def randn(*shape, seed: int, dtype=F64, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype=dtype, device=device)


def output_and_grads(fn, inputs, grad_out):
    """fn(*leaves) and d(fn . grad_out)/d leaves, for fresh leaf copies of inputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def make_backend(name: str):
    """(backend runnable on CPU float64, its stand-in kernel or None)."""
    if name == "sdpa":
        return SDPABackend(), None
    return stand_in_backend(name)


# (batch, q_len, k_len, n_heads, n_kv_heads, scale)
BACKEND_CASES = [
    (1, 7, 7, 4, 4, None),
    (2, 7, 7, 4, 2, 0.3),
    (1, 3, 8, 4, 4, 0.3),
    (2, 3, 8, 4, 2, None),
    (2, 5, 11, 4, 1, 0.7),
    (1, 1, 6, 4, 1, None),
    (2, 6, 6, 4, 1, 1.3),
]


def backend_inputs(batch, q_len, k_len, n_heads, n_kv, head_dim=8, seed=0):
    q = randn(batch, q_len, n_heads, head_dim, seed=seed)
    k = randn(batch, k_len, n_kv, head_dim, seed=seed + 1)
    v = randn(batch, k_len, n_kv, head_dim, seed=seed + 2)
    grad_out = randn(batch, q_len, n_heads, head_dim, seed=seed + 3)
    return (q, k, v), grad_out


# q, k, v (batch, heads, seq_len, head_dim) run segment by segment.
SegmentedRun = functools.partial(segmented.SegmentedRun, seq_dim=2)


def attention_inputs(batch, n_heads, n_kv, seq_len, head_dim=8, seed=0):
    q = randn(batch, n_heads, seq_len, head_dim, seed=seed)
    k = randn(batch, n_kv, seq_len, head_dim, seed=seed + 1)
    v = randn(batch, n_kv, seq_len, head_dim, seed=seed + 2)
    grad_out = randn(batch, n_heads, seq_len, head_dim, seed=seed + 3)
    return (q, k, v), grad_out


def compare_segmented(fn, inputs, grad_out, plan, family, rtol=EXACT) -> KVStore:
    """Segmented run == unsplit run (no unit active): outputs and every input grad.
    Returns the segmented run's store, freed."""
    ref, ref_grads = output_and_grads(fn, inputs, grad_out)
    store = KVStore()
    out, grads = SegmentedRun(fn, inputs, plan, store, microbatch=0).run(grad_out)
    assert len(store) == 0 and store.nbytes == 0
    assert_close(out, ref, family, rtol, what="out")
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert_close(g, rg, family, rtol, what=f"grad of input {i}")
    return store


PLANS = {
    "5-3-4": SegmentPlan.from_lengths((5, 3, 4)),
    "uniform4": SegmentPlan.uniform(12, 4),
    "1-1-10": SegmentPlan.from_lengths((1, 1, 10)),
    "single": SegmentPlan.from_lengths((12,)),
}
HEADS = {"mha": (4, 4), "gqa2": (4, 2), "gqa1": (4, 1)}


@dataclass(frozen=True)
class Case(exactness.Case):
    # "exact", or a GPU kernel's adapter run through its CPU stand-in
    # ("flash", "varlen", "cuda_exact"; see tests/kernel_fakes.py).
    kernel: str = "exact"


def pipelined(rank: int, world_size: int, case: Case, loss_normalizer: float | None = None) -> dict:
    """:func:`torchtitan_seq1f1b.check.exactness.pipelined`; through a stand-in
    kernel, the result also counts the attention calls that reached it
    (``kernel_calls``, training step and eval, dense and varlen stand-ins together)."""
    if case.kernel == "exact":
        return exactness.pipelined(rank, world_size, case, loss_normalizer)
    backend, stand_in = stand_in_backend(case.kernel)
    result = exactness.pipelined(rank, world_size, case, loss_normalizer, backend)
    varlen = backend.varlen_fake
    result["kernel_calls"] = len(stand_in.calls) + (0 if varlen is None else len(varlen.calls))
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]


def cases_and_control(run_one, cases: list, control, broken) -> dict:
    """``run_one(rank, 2, case)`` for every case, then for ``control`` inside ``broken()``
    (a context manager that breaks what the control must catch), in one 2-rank launch:
    {case: per-rank results, "control": per-rank results}."""
    per_rank = run_ranks(_cases_then_control, 2, run_one, cases, control, broken, timeout=300)
    results = {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}
    results["control"] = [rank[-1] for rank in per_rank]
    return results


def _cases_then_control(rank: int, world_size: int, run_one, cases, control, broken) -> list:
    results = [run_one(rank, world_size, case) for case in cases]
    with broken():
        results.append(run_one(rank, world_size, control))
    return results


def second_step_under(
    rank: int, world_size: int, case: Case, backend, counted: contextlib.AbstractContextManager
) -> list:
    """Build ``case``'s schedule on this rank with ``backend`` (None: exact), run a step
    (its first also runs torch's shape inference), then a second inside ``counted``,
    backward on a fresh thread as the case says; returns the rank's model parts."""
    schedule, parts, indices = exactness.build_schedule(rank, world_size, case, backend)
    has_last = exactness.holds_last_stage(case, world_size, indices)
    inputs, kwargs = exactness.step_inputs(rank, case, has_last)
    with backward_on_fresh_thread(case.device_thread):
        schedule.step(*inputs, **kwargs)
        for part in parts:
            part.zero_grad(set_to_none=True)
        with counted:
            schedule.step(*inputs, **kwargs)
    return parts


def _each_case(rank: int, world_size: int, worker, cases: list[Case]) -> list:
    return [worker(rank, world_size, case) for case in cases]


def runs_by_case(worker, world_size: int, cases: list[Case], timeout: float = 600) -> dict:
    """``{case: [worker(rank, world_size, case) for each rank]}``, all cases in one launch."""
    per_rank = run_ranks(_each_case, world_size, worker, cases, timeout=timeout)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}


def _reads_back(ids: torch.Tensor | None, plan: SegmentPlan) -> list[int | None]:
    """Per segment, the first earlier position its queries read (None: none).

    Written from the definition, position by position: the query at a
    segment's start sees back to the first token of its document.
    """
    reads = [None]
    for start in plan.offsets[1:]:
        if ids is None:
            reads.append(0)
            continue
        first = start
        for row in ids.tolist():
            u = start
            while u > 0 and row[u - 1] == row[start]:
                u -= 1
            first = min(first, u)
        reads.append(first if first < start else None)
    return reads


def expected_kv_peak_bytes(case: Case, order: Order, stage_index: int, num_stages: int) -> int:
    """The K/V store peak of one stage, replayed from the schedule's compute order.

    What the store must hold, independently of how it does so: per attention
    layer of the stage and per microbatch, from the microbatch's first
    forward until the backward of its segment 0 has run,

    - K and V from the first position a later segment reads back (0 for
      causal attention, whatever k; with packed documents, the start of the
      document at a later segment's start, when that document began before
      it) to the end of the sequence, two (microbatch_size, ., n_kv_heads, head_dim)
      tensors in the model's dtype;
    - from the first backward of a segment that reads back (whose prefix
      gradients must wait for earlier segments) until the backward of the
      last segment starting at or before that position (segment 0 for causal
      attention), layer by layer: dK and dV from that same position to
      ``offsets[-1]``, two tensors in fp32 or wider.

    A unit's backward is its B step, or its I step -- except on the first
    stage, where torch runs the whole backward in the W step; K/V go after
    segment 0's B or W step. The store records its peak after each layer's
    backward, so in the backward that drops them the first layer's gradients
    are already gone.
    """
    args = case.model_args
    plan = case.plan
    n_layers = len(case.model().stage(stage_index, num_stages).layers)
    per_token = case.microbatch_size * args.n_kv_heads * (args.dim // args.n_heads)
    grad_dtype = torch.promote_types(case.dtype, torch.float32)
    ids = case.document_ids()
    rows = case.microbatch_size
    reads = [
        _reads_back(None if ids is None else ids[i * rows : (i + 1) * rows], plan)
        for i in range(case.n_microbatches)
    ]
    # Causal attention keeps everything (a one-segment plan too: attention saves
    # views of the store instead of its own K/V).
    low = [
        0 if ids is None else min((r for r in mb if r is not None), default=plan.seq_len)
        for mb in reads
    ]
    kv_bytes = [2 * n_layers * per_token * (plan.seq_len - lo) * case.dtype.itemsize for lo in low]
    bank_bytes = [
        2 * n_layers * per_token * max(plan.offsets[-1] - lo, 0) * grad_dtype.itemsize
        for lo in low
    ]
    bank_until = [max(j for j, start in enumerate(plan.offsets) if start <= lo) for lo in low]
    with_kv, with_bank = set(), set()
    peak = 0
    for action in (a for actions in order.values() for a in actions if a.stage == stage_index):
        microbatch, segment = action.unit
        runs_backward = action.kind == "B" or (
            action.kind in "IW" and (action.kind == "I") == (stage_index > 0)
        )
        if action.kind == "F":
            with_kv.add(microbatch)
        elif runs_backward and reads[microbatch][segment] is not None:
            with_bank.add(microbatch)
        held = sum(kv_bytes[i] for i in with_kv) + sum(bank_bytes[i] for i in with_bank)
        if runs_backward and segment == bank_until[microbatch] and microbatch in with_bank:
            held -= bank_bytes[microbatch] // n_layers
            with_bank.discard(microbatch)
        peak = max(peak, held)
        if action.kind in "BW" and segment == 0:
            with_kv.discard(microbatch)
    return peak


# ---- negative controls ----------------------------------------------------------

BREAKS = ("prefix_grads", "prefix_attention", "w_order", "document_mask")


def _attach_own_tokens(self, layer, k, v):
    return k, v


def _prefix_own_tokens(self, layer, k, v, write):
    return k, v, lambda grad_k, grad_v: (grad_k, grad_v), None


# KVStore methods under which every segment attends to its own tokens only: the
# autograd path's and the registered op's.
OWN_TOKENS_ONLY = {"attach": _attach_own_tokens, "prefix": _prefix_own_tokens}


def attend_own_tokens_only() -> contextlib.ExitStack:
    """Patch :data:`OWN_TOKENS_ONLY` into KVStore until the returned stack closes."""
    stack = contextlib.ExitStack()
    for name, method in OWN_TOKENS_ONLY.items():
        stack.enter_context(mock.patch.object(kv_store.KVStore, name, method))
    return stack


def _first_stage_weights_first_segment_first(order: Order) -> Order:
    """Stage 0's W steps of each microbatch moved after its last I step, segment 0 first.

    On the first stage the W step holds the whole backward, so this runs
    segment 0's K/V gradient before later segments have banked theirs.
    """
    reordered = {}
    for rank, actions in order.items():
        weights = defaultdict(list)
        for action in actions:
            if action.stage == 0 and action.kind == "W":
                weights[action.microbatch].append(action)
        kept = []
        for action in actions:
            if action.stage == 0 and action.kind == "W":
                continue
            kept.append(action)
            if action.stage == 0 and action.kind == "I" and action.segment == 0:
                kept += sorted(weights[action.microbatch], key=lambda a: a.segment)
        reordered[rank] = kept
    return reordered


@contextlib.contextmanager
def broken(what: str, case: Case) -> Iterator[None]:
    """Switch off one part of the cross-segment machinery (one of BREAKS).

    - "prefix_grads": dK/dV of the prefix are dropped instead of routed to
      the earlier segments' backward;
    - "prefix_attention": a segment attends to its own tokens only;
    - "w_order": on a split-backward schedule's first stage, W steps run
      first segment first (the order validator, which rejects that, is
      bypassed);
    - "document_mask": the schedule drops the document ids it is given, so
      attention is causal across documents.
    """
    if what == "prefix_grads":
        patch = mock.patch.object(
            kv_store._PrefixBuffers,
            "take_grads",
            lambda self, key_start, start, end, gk, gv: (
                gk[:, start - key_start :], gv[:, start - key_start :]
            ),
        )
    elif what == "prefix_attention":
        patch = attend_own_tokens_only()
    elif what == "w_order":
        cls = SCHEDULES[case.schedule]
        build = cls._build_segment_order
        patch = contextlib.ExitStack()
        patch.enter_context(mock.patch.object(schedule_module, "validate_order", lambda *a: None))
        patch.enter_context(
            mock.patch.object(
                cls,
                "_build_segment_order",
                lambda self: _first_stage_weights_first_segment_first(build(self)),
            )
        )
    elif what == "document_mask":
        patch = contextlib.ExitStack()
        patch.enter_context(
            mock.patch.object(schedule_module, "MicrobatchDocuments", lambda *args: None)
        )
        patch.enter_context(
            mock.patch.object(schedule_module, "upload_varlen_layouts", lambda *args: None)
        )
    else:
        raise ValueError(f"unknown break {what!r}; choose one of {BREAKS}")
    with patch:
        yield


def pipelined_broken(rank: int, world_size: int, runs: list[tuple[Case, str]]) -> list[dict]:
    """:func:`pipelined` for each (case, break) with that part switched off."""
    results = []
    for case, what in runs:
        with broken(what, case):
            results.append(pipelined(rank, world_size, case))
    return results


def assert_matches_reference(ranks: list[dict], case: Case, rtol: float, atol: float) -> None:
    """Every rank's :func:`pipelined` result together equals the unsplit reference:
    each parameter's gradient (held by exactly one rank), each microbatch's loss
    sum and the eval logits (on the last rank)."""
    ref = reference(case)
    grads = {}
    for rank in ranks:
        assert not grads.keys() & rank["grads"].keys()
        grads.update(rank["grads"])
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=rtol, atol=atol, msg=name)
    last = ranks[-1]
    assert len(last["losses"]) == case.n_microbatches
    for microbatch, (loss, expected) in enumerate(zip(last["losses"], ref["loss_sums"])):
        torch.testing.assert_close(loss, expected, rtol=rtol, atol=0, msg=f"microbatch {microbatch}")
    torch.testing.assert_close(last["logits"], ref["logits"], rtol=rtol, atol=atol)


def worst_relative_grad_error(ranks: list[dict], ref: dict) -> float:
    """max over parameters of max|g - g_ref| / max|g_ref|."""
    return max(
        ((g - ref["grads"][n]).abs().max() / ref["grads"][n].abs().max()).item()
        for rank in ranks
        for n, g in rank["grads"].items()
    )


# torchtitan runs in float32 from one seed checkpoint: Seq1F1B against the
# non-pipelined run, per-step losses and the step-1 grad_norm.
TORCHTITAN_RTOL = 1e-4
# The tokens a test job's schedule cuts, the option naming them, and its rows per
# microbatch: 2 rows of 128 on torchtitan 0.3, a packed row of 256 on main.
JOB_TOKENS, JOB_TOKENS_OPTION, JOB_ROWS = (
    (256, "training.num_tokens_per_microbatch_per_dp_rank", 1)
    if titan_release() == MAIN
    else (128, "training.seq_len", 2)
)
# A test job's validation data: 0.3's packed documents (main's dataset is no flag).
VALIDATION_DATA_ARGS = (
    () if titan_release() == MAIN
    else ("--validator.dataloader.dataset_path", "doc_tokens=41,words=64")
)
# The resume tests' runs: resumed from step 2's checkpoint, the second of the two
# steps after it runs on state the first updated after the resume.
RESUME_STEPS = ("--training.steps", "4")


COMPILE_ARGS = ("--compile.enable",)
# A torchtitan run's environment that logs every recompile with its reason.
RECOMPILE_LOGS = {"TORCH_LOGS": "recompiles"}


def compiled_run_matches(run, reference: Run, stages: int, *args: str) -> None:
    """A 2-rank compiled run of ``args`` (``run``: the integration fixture) compiles
    its ``stages`` stages' blocks, trains as ``reference`` does (see
    :func:`assert_same_training`) and recompiles only for lengths: on uneven
    segments each rank's blocks once and the last rank's loss once, to dynamic
    sequence lengths, never per segment, microbatch or step."""
    compiled = run(2, *COMPILE_ARGS, *args, name="compiled", extra_env=RECOMPILE_LOGS)
    assert compiled.output.count("Compiling each TransformerBlock with torch.compile") == stages
    assert_same_training(compiled, reference)
    reasons = [
        line.split("[__recompiles]")[1]
        for line in compiled.output.splitlines()
        if "[__recompiles]     - " in line
    ]
    assert len(reasons) == 3, reasons
    # The sequence dim: 1 of [B, L], 0 of torchtitan main's packed [T].
    seq_dim = 0 if titan_release() == MAIN else 1
    assert all(f"size mismatch at index {seq_dim}" in reason for reason in reasons), reasons


def compiled_parallel_matches(run, degree_args: tuple[str, ...]) -> None:
    """Compiled PP=2 with ``degree_args`` (FSDP or TP degrees) trains as the compiled
    run with those degrees and no pipeline. Both compile with the aot_eager backend:
    dynamo and AOTAutograd as with Inductor, whose code generation the runs of
    :func:`compiled_run_matches` cover, at a fraction of the compile time."""
    compile_args = (*COMPILE_ARGS, "--compile.backend", "aot_eager")
    dp = 2 if "--parallelism.data_parallel_shard_degree" in degree_args else 1
    reference = run(
        2, *unpipelined_args(dp), *degree_args, *compile_args, name="compiled_reference"
    )
    compiled = run(4, *degree_args, *compile_args, name="compiled_pp")
    assert_same_training(compiled, reference)


def assert_same_training(
    run: Run, reference: Run, rtol: float = TORCHTITAN_RTOL, min_steps: int = 3
) -> None:
    """Same logged steps (at least ``min_steps``), losses and step-1 grad_norm within ``rtol``.

    The grad_norm catches normalisation bugs that clipping and Adam would hide
    in the loss curve.
    """
    steps = sorted(reference.losses)
    assert len(steps) >= min_steps
    assert sorted(run.losses) == steps
    for step in steps:
        assert run.losses[step] == pytest.approx(reference.losses[step], rel=rtol), step
    assert run.grad_norms[1] == pytest.approx(reference.grad_norms[1], rel=rtol)


def largest_difference(run: Run, reference: Run) -> float:
    """Largest relative difference of a step's loss or the step-1 grad_norm."""
    pairs = [(run.losses[s], reference.losses[s]) for s in reference.losses]
    pairs.append((run.grad_norms[1], reference.grad_norms[1]))
    return max(abs(value / expected - 1) for value, expected in pairs)

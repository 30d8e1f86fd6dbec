# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.check`` on CPU: its table and exit codes,
that each check fails when what it checks is broken, and the GPU-skip rule."""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchtitan_seq1f1b.attention import exact, SDPABackend
import torchtitan_seq1f1b.check.__main__ as check_main
from torchtitan_seq1f1b.check import distributed, perf, stack
from torchtitan_seq1f1b.check.__main__ import main
from torchtitan_seq1f1b.examples.tiny_transformer import ACTIVATION_CHECKPOINT_MODES
from torchtitan_seq1f1b.kv_store import KVStore

from tests import conftest
from tests.harness import OWN_TOKENS_ONLY

REPO = Path(__file__).resolve().parents[2]


def test_cpu_check_passes(tmp_path):
    report = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_seq1f1b.check", "--device", "cpu", "--json", str(report)],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["name"]: row for row in json.loads(report.read_text())["results"]}
    for name, row in rows.items():
        assert name in result.stdout and row["status"].upper() in result.stdout
    assert "0 failed" in result.stdout
    assert rows["kernel gdn-fla bfloat16 d64"]["reason"] == "needs a CUDA device (this runs on cpu)"
    for head_dim in (64, 128):
        # kernels that need CUDA are skipped, never passed
        for kind in ("flash", "varlen"):
            for path in ("kernel", "kernel-op"):
                assert rows[f"{path} {kind} bfloat16 d{head_dim}"]["status"] == "skip"
        for dtype in ("bfloat16", "float64"):
            for path in ("kernel", "kernel-op"):
                row = rows[f"{path} sdpa {dtype} d{head_dim}"]
                assert row["status"] == "pass"
                assert 0 <= row["measured"]["error"] <= row["measured"]["bound"]
        for mode in ACTIVATION_CHECKPOINT_MODES:
            for dtype in ("float32", "bfloat16"):
                row = rows[f"stack d{head_dim} {dtype} ac={mode}"]
                assert row["status"] == "pass", row
                assert row["measured"]["peak_mib"] == "n/a"
                assert row["measured"]["segments"] == list(stack.CPU_LENGTHS)


def test_without_cuda_nothing_is_checked(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device: nothing checked")
    for name in ("kernels", "stack", "pipelined", "torchtitan"):
        assert f"  {name}: " in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def _stack_rows(monkeypatch, capsys, modes: tuple[str, ...]) -> tuple[int, dict[str, str]]:
    """Exit code and {row name: line} of the stack check on d64 in ``modes``."""
    monkeypatch.setattr(stack, "MODELS", {"d64": stack.MODELS["d64"]})
    monkeypatch.setattr(stack, "ACTIVATION_CHECKPOINT_MODES", modes)
    code = main(["--device", "cpu", "--checks", "stack"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stack d64")]
    assert len(lines) == 2 * len(modes), lines
    return code, {" ".join(line.split()[:4]): line for line in lines}


def test_stack_check_fails_without_the_prefix(monkeypatch, capsys):
    """Segments that attend only to themselves fail every row."""
    for name, method in OWN_TOKENS_ONLY.items():
        monkeypatch.setattr(KVStore, name, method)
    code, rows = _stack_rows(monkeypatch, capsys, ("none", "selective_op"))
    assert code == 1
    assert all(" FAIL " in line and "> bound" in line for line in rows.values()), rows


def test_stack_check_runs_backward_on_another_thread(monkeypatch, capsys):
    """A running unit only the forward's thread can see (a thread-local, as a
    ContextVar would be) breaks checkpoint recompute in backward: the check
    must fail under full checkpointing and pass without checkpointing."""
    local = threading.local()
    running = property(
        lambda self: getattr(local, "unit", None), lambda self, unit: setattr(local, "unit", unit)
    )
    monkeypatch.setattr(KVStore, "running", running, raising=False)
    code, rows = _stack_rows(monkeypatch, capsys, ("none", "full"))
    assert code == 1
    for dtype in ("float32", "bfloat16"):
        assert " PASS " in rows[f"stack d64 {dtype} ac=none"], rows
        assert " FAIL " in rows[f"stack d64 {dtype} ac=full"], rows


def _top_left_causal(self, q, k, v, scale):
    """A plausible bug: SDPA's is_causal is top-left aligned when Lq < Lk."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=True,
    ).transpose(1, 2)


def test_kernel_check_fails_with_a_top_left_mask(monkeypatch, capsys):
    monkeypatch.setattr(SDPABackend, "__call__", _top_left_causal)
    assert main(["--device", "cpu", "--checks", "kernels"]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("kernel sdpa")]
    assert len(rows) == 4 and all(" FAIL " in row for row in rows), out


def _kernel_op_rows(capsys) -> tuple[int, list[str]]:
    code = main(["--device", "cpu", "--checks", "kernels"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kernel-op sdpa")]
    assert len(rows) == 4, rows
    return code, rows


def test_kernel_op_check_runs_the_math_kernel_and_fails_with_a_wrong_logsumexp(
    monkeypatch, capsys
):
    """The op's path on CUDA float64 (masked math) passes on CPU; its backward reads
    the forward's logsumexp, so a wrong one fails every op row."""
    monkeypatch.setattr(SDPABackend, "device_kernel", lambda self, q: "math")
    code, rows = _kernel_op_rows(capsys)
    assert code == 0 and all(" PASS " in row for row in rows), rows
    forward = exact.math_forward

    def shifted_lse(*args):
        out, lse = forward(*args)
        return out, lse + 0.1

    monkeypatch.setattr(exact, "math_forward", shifted_lse)
    code, rows = _kernel_op_rows(capsys)
    assert code == 1 and all(" FAIL " in row for row in rows), rows


def test_pipelined_check_on_gloo(monkeypatch):
    """Two float64 cases on 2 gloo ranks, two under CP = 2 x PP = 2 on 4; the second
    of each compares against a reference nudged by 1e-6, which the check must catch."""
    monkeypatch.setattr(distributed, "STAGES_PER_RANK", {"Seq1F1B": 1})
    monkeypatch.setattr(distributed, "ACTIVATION_CHECKPOINT_MODES", ("selective_layer", "full"))
    monkeypatch.setattr(distributed, "CP_CHECKPOINT_MODES", ("none", "full"))
    exact = distributed.reference

    def reference(case):
        ref = exact(case)
        if case.activation_checkpoint == "full":
            ref["grads"]["output.weight"] *= 1 + 1e-6
        return ref

    monkeypatch.setattr(distributed, "reference", reference)
    passed, nudged, cp_passed, cp_nudged = distributed.pipelined_results(torch.device("cpu"))
    assert passed.name == "pipelined Seq1F1B ac=selective_layer (2 ranks, gloo)"
    assert cp_passed.name == "pipelined CP=2 x PP=2 Seq1F1B ac=none (4 ranks, gloo)"
    for row in (passed, cp_passed):
        assert row.status == "pass" and row.measured["error"] < 1e-12, row
    for row in (nudged, cp_nudged):
        assert row.status == "fail" and 1e-7 < row.measured["error"] < 1e-5, row


def _report_after_hook(marker: str | None, cuda: bool, monkeypatch, reason="needs flash_attn"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    item = types.SimpleNamespace(get_closest_marker=lambda name: name == marker or None)
    report = types.SimpleNamespace(
        skipped=True, outcome="skipped", longrepr=("test.py", 1, f"Skipped: {reason}")
    )
    hook = conftest.pytest_runtest_makereport(item, None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(types.SimpleNamespace(get_result=lambda: report))
    return report


def test_gpu_tests_may_not_skip_with_cuda(monkeypatch):
    report = _report_after_hook("gpu", cuda=True, monkeypatch=monkeypatch)
    assert report.outcome == "failed"
    assert report.longrepr == "gpu test skipped on a machine with CUDA: Skipped: needs flash_attn"
    assert _report_after_hook("gpu", cuda=False, monkeypatch=monkeypatch).outcome == "skipped"
    assert _report_after_hook(None, cuda=True, monkeypatch=monkeypatch).outcome == "skipped"
    # a GPU that cannot run the kernel at all is a real skip
    hardware = _report_after_hook(
        "gpu", cuda=True, monkeypatch=monkeypatch, reason="hardware: FlashAttention 2 needs sm80+"
    )
    assert hardware.outcome == "skipped"


def test_perf_reports_every_configuration_and_counts_recompute(tmp_path, monkeypatch, capsys):
    shape = dataclasses.replace(perf.CPU_SHAPE, seq_lens=(64,), segment_counts=(1, 2, 4))
    monkeypatch.setattr(perf, "CPU_SHAPE", shape)
    monkeypatch.setattr(check_main, "CPU_SHAPE", shape)
    report = tmp_path / "perf.json"
    assert main(["--perf", "--device", "cpu", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == len(ACTIVATION_CHECKPOINT_MODES) * 3
    recomputed = {"none": 0, "full": 2, "selective_layer": 1, "selective_op": 0}
    for row in rows:
        assert f"{row['seq_len']:>6} {row['mode']:<15} {row['k']:>2} " in out
        assert sum(row["plan"]) == 64 and len(row["forward"]) == len(row["backward"]) == row["k"]
        assert all(t > 0 for t in row["forward"] + row["backward"])
        # attention runs once per unit and block, again where checkpointing recomputes it
        assert row["attention_forwards"] == row["k"] * (shape.blocks + recomputed[row["mode"]])
        assert row["host_reads"] == row["uploads"] == 0 and row["syncs"] is None
        assert (row["k"] > 1) == bool(row["speedup"])
        assert all(0 < s < float("inf") for s in row["speedup"].values())


def test_perf_measures_instead_of_checking(capsys):
    with pytest.raises(SystemExit):
        main(["--perf", "--checks", "stack", "--device", "cpu"])
    assert "--perf measures instead of checking" in capsys.readouterr().err

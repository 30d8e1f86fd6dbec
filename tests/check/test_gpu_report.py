# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.check --gpu-report OUTDIR --device cpu``: its files,
its four sections in order, the multi-GPU checks skipped by name, what it
imports, and a time budget too small for anything."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_seq1f1b._torch_compat import TORCH_RELEASE
from torchtitan_seq1f1b.check import Result, Task
from torchtitan_seq1f1b.check.__main__ import main
from torchtitan_seq1f1b.check.distributed import (
    context_parallel_names,
    pipelined_names,
    TORCHTITAN_ROW,
)
from torchtitan_seq1f1b.check.report import Budget, Section, TIME_BUDGET

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ["perf", "kernels", "check", "compiled"]
MIB = 2**20


def _gpu_report(folder: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the command from the source tree, as on the GPU machine; its result and report.json."""
    command = ["-m", "torchtitan_seq1f1b.check", "--gpu-report", str(folder), "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, *command, *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    files = list(folder.iterdir())
    assert {"report.json", "report.txt"} <= {f.name for f in files} and len(files) <= 8, files
    assert all(f.stat().st_size < 16 * MIB for f in files)
    return result, json.loads((folder / "report.json").read_text())


def _multi_gpu_rows() -> dict[str, str]:
    """{row name: why it skips on CPU}."""
    cpu = torch.device("cpu")
    rows = {name: "needs 2 GPUs" for name in (*pipelined_names(cpu), TORCHTITAN_ROW)}
    return rows | {name: "needs 4 GPUs" for name in context_parallel_names(cpu)}


# The GPU machines lent here run torch 2.11 (.ci/gpu-image.txt): CI rehearses the whole
# report in that image; later releases run each section's own tests.
@pytest.mark.skipif(
    TORCH_RELEASE > (2, 12), reason="rehearsed on torch 2.11-2.12, which GPU machines run"
)
def test_the_report_runs_every_section_and_skips_the_multi_gpu_checks(tmp_path):
    result, report = _gpu_report(tmp_path)
    assert report["finished"] and report["counts"]["fail"] == 0 and report["counts"]["pass"] > 0
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert all(s["status"] == "ran" and s["rows"] for s in report["sections"]), report["sections"]
    assert set(report["versions"]) >= {"python", "torch", "cuda", "cudnn", "triton"}
    assert report["device"]["type"] == "cpu" and isinstance(report["device"]["gpus"], int)
    # the tables, printed and written: --perf's rows as it prints them, the others by name
    text = (tmp_path / "report.txt").read_text()
    perf = report["sections"][0]["rows"]
    shown = [f"{m['seq_len']:>6} {m['mode']:<15} {m['k']:>2} " for m in (r["measured"] for r in perf)]
    shown += [row["name"] for s in report["sections"][1:] for row in s["rows"]]
    assert all(line in result.stdout and line in text for line in shown)
    # the multi-GPU checks are rows of the check section, skipped with their reason
    check_rows = {row["name"]: row for row in report["sections"][2]["rows"]}
    skipped = {row["name"]: row["reason"] for row in report["skipped"]}
    for name, needs in _multi_gpu_rows().items():
        assert check_rows[name]["status"] == "skip" and needs in skipped[name], name
    for row in perf:
        assert row["status"] == "pass" and len(row["measured"]["forward"]) == row["measured"]["k"]
    (compiled,) = report["sections"][3]["rows"]
    assert compiled["status"] == "pass" and compiled["measured"]["graphs"] == 2, compiled
    # runnable without what the GPU image lacks
    assert "torchtitan_seq1f1b" in report["modules"]
    assert not {"datasets", "torchtitan", "flash_attn"} & set(report["modules"])


def test_a_spent_budget_skips_every_section_and_still_writes_the_report(tmp_path):
    result, report = _gpu_report(tmp_path, "--budget-s", "0")
    assert report["finished"] and report["counts"]["pass"] == report["counts"]["fail"] == 0
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert report["not_run_for_budget"] == SECTIONS
    multi_gpu = _multi_gpu_rows()
    for section in report["sections"]:
        assert section["status"] == f"skipped: {TIME_BUDGET}" and section["rows"]
        for row in section["rows"]:
            assert row["status"] == "skip"
            if row["name"] in multi_gpu:
                assert multi_gpu[row["name"]] in row["reason"], row
            else:
                assert row["reason"] == TIME_BUDGET, row
    assert f"not run for the time budget: {', '.join(SECTIONS)}" in result.stdout
    assert TIME_BUDGET in (tmp_path / "report.txt").read_text()


def test_a_section_stops_where_its_budget_ends_and_fails_a_crashed_task():
    budget = Budget(100.0)

    def taking(seconds: float, name: str) -> Task:
        def run() -> list[Result]:
            budget.started -= seconds  # as if it took that long
            return [Result(name, "pass")]

        return Task((name,), run)

    def crash() -> list[Result]:
        raise RuntimeError("boom")

    tasks = [
        Task(("crashes",), crash),
        taking(60.0, "slow"),
        taking(0.0, "next"),  # 40 s left, 20 kept for later sections: less than the 60 s of "slow"
        Task(("unmet",), crash, unmet="needs 2 GPUs"),
    ]
    section = Section("s", "a section", tasks, expected_s=4.0)
    section.run(budget, reserve_s=20.0, after_task=lambda: None)
    assert [(row.name, row.status, row.reason) for row in section.rows] == [
        ("crashes", "fail", "crashed: RuntimeError: boom"),
        ("slow", "pass", ""),
        ("next", "skip", TIME_BUDGET),
        ("unmet", "skip", "needs 2 GPUs"),
    ]
    assert section.status == f"partly skipped: {TIME_BUDGET}"


@pytest.mark.parametrize(
    "args, error",
    [
        (["--perf"], "leave out --perf"),
        (["--checks", "stack"], "leave out --checks"),
        (["--json", "x.json"], "leave out --json"),
    ],
)
def test_the_report_runs_its_own_sections(tmp_path, capsys, args, error):
    with pytest.raises(SystemExit) as exit_info:
        main(["--gpu-report", str(tmp_path), "--device", "cpu", *args])
    assert exit_info.value.code == 2 and error in capsys.readouterr().err


def test_the_budget_is_the_reports(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--budget-s", "10", "--device", "cpu"])
    assert exit_info.value.code == 2 and "add --gpu-report OUTDIR" in capsys.readouterr().err

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.check --gpu-report OUTDIR``: what one GPU can tell, in one go.

Four sections, in order of how much their numbers matter:

1. ``perf``: ``--perf``'s table (:mod:`~torchtitan_seq1f1b.check.perf`);
2. ``kernels``: every attention backend against exact attention;
3. ``check``: the segmented stack, and the multi-GPU checks (run on 2 GPUs only,
   else skipped by name with the reason);
4. ``compiled``: a block compiled with ``fullgraph=True``, segment by segment
   (:mod:`~torchtitan_seq1f1b.check.compiled`).

A section runs task by task (a ``--perf`` sequence length and checkpointing
mode, a kernel row, a stack model, ...). A task starts only if the time budget
left, less what the later sections are expected to need (:data:`EXPECTED_S`),
covers the longest task of its section so far (at first: its share of the
section's expectation); otherwise its rows are skipped for the "time budget".
``OUTDIR/report.json`` (everything, with the machine's versions and the
modules loaded) and ``OUTDIR/report.txt`` (the tables) are rewritten after
every task, so a run killed early leaves what it measured.
"""

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchtitan_seq1f1b.check import format_table, Result, Task
from torchtitan_seq1f1b.check.compiled import compiled_task
from torchtitan_seq1f1b.check.distributed import multi_gpu_tasks
from torchtitan_seq1f1b.check.environment import device_facts, loaded_packages, versions
from torchtitan_seq1f1b.check.kernels import kernel_tasks
from torchtitan_seq1f1b.check.perf import CPU_SHAPE, format_perf, GPU_SHAPE, perf_tasks, PerfShape
from torchtitan_seq1f1b.check.stack import stack_tasks

__all__ = ["Budget", "EXPECTED_S", "Report", "Section", "TIME_BUDGET", "gpu_report", "sections"]

TIME_BUDGET = "time budget"
# Seconds each section is expected to take (an H100; the 2-core CPU runner): a section
# leaves this much of the budget to the sections after it.
EXPECTED_S = {
    "cuda": {"perf": 240.0, "kernels": 20.0, "check": 30.0, "compiled": 120.0},
    "cpu": {"perf": 15.0, "kernels": 10.0, "check": 20.0, "compiled": 20.0},
}
# --perf times 3 steps per configuration; 2 keep its table within the report's budget.
REPORT_REPEATS = 2


@dataclasses.dataclass
class Budget:
    """``seconds`` from ``started`` (``time.perf_counter``)."""

    seconds: float
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()


@dataclasses.dataclass
class Section:
    """One part of the report: its tasks, and the rows they gave once run."""

    name: str
    title: str
    tasks: list[Task]
    expected_s: float
    render: Callable[[list[Result]], str] = format_table
    rows: list[Result] = dataclasses.field(default_factory=list)
    status: str = "pending"
    seconds: float = 0.0

    def run(self, budget: Budget, reserve_s: float, after_task: Callable[[], None]) -> None:
        """Every task the budget allows, leaving ``reserve_s`` to later sections."""
        self.status = "running"
        started = budget.elapsed()
        longest = self.expected_s / max(len(self.tasks), 1)
        for task in self.tasks:
            if task.unmet or budget.left() - reserve_s < longest:
                self.rows += task.skipped(task.unmet or TIME_BUDGET)
                continue
            task_started = budget.elapsed()
            try:
                self.rows += task.run()
            except Exception as crash:  # noqa: BLE001 - a crashed task fails its rows
                self.rows += task.crashed(crash)
            took = budget.elapsed() - task_started
            more = " ..." if len(task.names) > 1 else ""
            print(f"  {task.names[0]}{more}: {took:.1f} s", file=sys.stderr, flush=True)
            longest = max(longest, took)
            self.seconds = budget.elapsed() - started
            after_task()
        self.seconds = budget.elapsed() - started
        self.status = self._final_status()

    def _final_status(self) -> str:
        budgeted = sum(row.reason == TIME_BUDGET for row in self.rows)
        if not budgeted:
            return "ran"
        runnable = sum(len(task.names) for task in self.tasks if not task.unmet)
        return f"{'skipped' if budgeted == runnable else 'partly skipped'}: {TIME_BUDGET}"

    def text(self, number: int) -> str:
        state = self.status if self.status != "ran" else f"ran in {self.seconds:.0f} s"
        return f"== {number}. {self.name}: {self.title} ({state}) ==\n{self.render(self.rows)}"


def _perf_section(device: torch.device, expected_s: float) -> Section:
    full = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    shape = dataclasses.replace(full, repeats=min(full.repeats, REPORT_REPEATS))
    note = (
        f"\n(the report times {shape.repeats} steps per configuration; --perf times {full.repeats})"
        if shape.repeats < full.repeats
        else ""
    )
    return Section(
        "perf",
        f"Seq1F1B units of a {shape.blocks}-block stage ({shape.name}) and predicted steps",
        perf_tasks(device, shape),
        expected_s,
        lambda rows: _perf_table(rows, shape) + note,
    )


def _perf_table(rows: list[Result], shape: PerfShape) -> str:
    """``--perf``'s table of the measured rows; the others (skipped, crashed) in the check table."""
    measured = [row.measured for row in rows if row.measured]
    others = [row for row in rows if not row.measured]
    tables = [format_perf(measured, shape)] if measured else []
    return "\n".join(tables + ([format_table(others)] if others else []))


def sections(device: torch.device) -> list[Section]:
    expected = EXPECTED_S[device.type]
    return [
        _perf_section(device, expected["perf"]),
        Section(
            "kernels",
            "attention backends on a segment after its prefix, against exact attention",
            kernel_tasks(device),
            expected["kernels"],
        ),
        Section(
            "check",
            "a llama3-shaped stack segment by segment against unsplit training; multi-GPU checks",
            stack_tasks(device) + multi_gpu_tasks(device),
            expected["check"],
        ),
        Section(
            "compiled",
            "a block compiled with fullgraph=True, segment by segment, against the eager block",
            [compiled_task(device)],
            expected["compiled"],
        ),
    ]


@dataclasses.dataclass
class Report:
    """The sections and the facts of the run they were made in."""

    command: str
    device: torch.device
    budget: Budget
    sections: list[Section]
    facts: dict = dataclasses.field(init=False)
    versions: dict = dataclasses.field(init=False)
    took_s: float | None = None  # set when the last section has run

    def __post_init__(self):
        self.facts, self.versions = device_facts(self.device), versions()

    def elapsed(self) -> float:
        return self.budget.elapsed() if self.took_s is None else self.took_s

    def rows(self) -> list[tuple[Section, Result]]:
        return [(section, row) for section in self.sections for row in section.rows]

    def counts(self) -> dict[str, int]:
        return {s: sum(row.status == s for _, row in self.rows()) for s in ("pass", "fail", "skip")}

    def not_run_for_budget(self) -> list[str]:
        return [s.name for s in self.sections if s.status == f"skipped: {TIME_BUDGET}"]

    def summary(self) -> str:
        counts = self.counts()
        budgeted = sum(row.reason == TIME_BUDGET for _, row in self.rows())
        lines = [
            f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
            f"({budgeted} for the time budget) in {self.elapsed():.0f} s "
            f"of a {self.budget.seconds:.0f} s budget"
        ]
        if self.took_s is None:
            lines.append("unfinished: the report was written while running")
        if names := self.not_run_for_budget():
            lines.append(f"not run for the time budget: {', '.join(names)}")
        return "\n".join(lines)

    def header(self) -> str:
        facts, v = self.facts, self.versions
        gpus = f"{facts['gpus']} GPU(s)"
        return (
            f"{self.command}\n{facts['name']} ({facts['type']}, {gpus}); python {v['python']}, "
            f"torch {v['torch']}, CUDA {v['cuda']}, cuDNN {v['cudnn']}, triton {v['triton']}"
        )

    def text(self) -> str:
        shown = [
            section.text(number)
            for number, section in enumerate(self.sections, 1)
            if section.status != "pending"
        ]
        return "\n\n".join([self.header(), *shown, self.summary()]) + "\n"

    def as_json(self) -> dict:
        return {
            "command": self.command,
            "finished": self.took_s is not None,
            "device": self.facts,
            "versions": self.versions,
            "budget_s": self.budget.seconds,
            "elapsed_s": round(self.elapsed(), 1),
            "counts": self.counts(),
            "sections": [
                {
                    "name": s.name,
                    "title": s.title,
                    "status": s.status,
                    "seconds": round(s.seconds, 1),
                    "rows": [dataclasses.asdict(row) for row in s.rows],
                }
                for s in self.sections
            ],
            "skipped": [
                {"section": section.name, "name": row.name, "reason": row.reason}
                for section, row in self.rows()
                if row.status == "skip"
            ],
            "not_run_for_budget": self.not_run_for_budget(),
            "modules": loaded_packages(),
        }

    def write(self, folder: Path) -> None:
        """report.json and report.txt, each replaced whole (a kill leaves the last ones)."""
        folder.mkdir(parents=True, exist_ok=True)
        # default=str: an odd value in a row must not lose the report at its end.
        contents = {
            "report.json": json.dumps(self.as_json(), indent=1, default=str),
            "report.txt": self.text(),
        }
        for name, content in contents.items():
            partial = folder / f".{name}.partial"
            partial.write_text(content)
            os.replace(partial, folder / name)


def gpu_report(folder: Path, device: torch.device, budget_s: float, command: str) -> int:
    """Run the sections on ``device`` within ``budget_s``, writing ``folder``'s files
    and printing each section's table; 1 if any row failed, else 0."""
    report = Report(command, device, Budget(budget_s), sections(device))
    report.write(folder)
    print(report.header(), flush=True)
    for number, section in enumerate(report.sections, 1):
        reserve_s = sum(later.expected_s for later in report.sections[number:])
        section.run(report.budget, reserve_s, lambda: report.write(folder))
        report.write(folder)
        print(f"\n{section.text(number)}", flush=True)
    report.took_s = report.budget.elapsed()
    report.write(folder)
    print(f"\n{report.summary()}\nwritten: {folder / 'report.json'}, {folder / 'report.txt'}")
    return 1 if report.counts()["fail"] else 0

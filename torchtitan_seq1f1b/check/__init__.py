# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One-command check of Seq1F1B on a GPU machine: ``python -m torchtitan_seq1f1b.check``.

Checks, each a function of the device returning result rows:

- ``kernels``: every attention backend that runs on the device, on a segment
  attending to a longer prefix (bottom-right causal), GQA, head dims 64 and
  128, batch 1 and 2: output and dq/dk/dv against exact float64 attention;
  and GatedDeltaNet's fla recurrence in a segmented bf16 layer against the
  exact path in float64 unsplit (:mod:`.gated_delta_net`).
- ``stack``: a llama3-shaped stack run segment by segment on one device
  (backward on autograd's device thread) under every activation
  checkpointing mode, against unsplit training; peak memory per segment.
- ``pipelined``: float64 exactness of every schedule on 2 ranks (NCCL on
  GPUs, gloo on CPU) against unsplit training, and with context parallelism
  inside the pipeline (CP = 2 x PP = 2) on 4 ranks.
- ``torchtitan``: a short torchtitan job, Seq1F1B PP=2 against a
  non-pipelined run from one seed checkpoint.

The result is a pass/fail/skip table; the exit code is 1 if any row failed.
``--gpu-report`` runs the single-GPU checks with ``--perf``'s table and a
compiled block under a time budget (:mod:`~torchtitan_seq1f1b.check.report`).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Result", "Task", "format_table", "relative_error", "run_tasks", "worst"]


@dataclass
class Result:
    """One row of the check's table.

    ``measured`` holds the numbers behind the verdict (errors, bounds, MiB);
    ``reason`` says why a row failed or was skipped.
    """

    name: str
    status: str  # "pass", "fail" or "skip"
    measured: dict = field(default_factory=dict)
    reason: str = ""

    @classmethod
    def bounded(cls, name: str, error: float, bound: float, **measured) -> "Result":
        """pass iff ``error <= bound`` (a NaN error fails)."""
        ok = error <= bound and not math.isnan(error)
        reason = "" if ok else f"error {error:.3g} > bound {bound:.3g}"
        return cls(name, "pass" if ok else "fail", {"error": error, "bound": bound, **measured}, reason)


@dataclass(frozen=True)
class Task:
    """Rows a check computes together, named before they run: a time budget can
    skip them by name, and a crash fails each of them. ``unmet`` says why they
    cannot run here ("" if they can); they are then skipped with that reason."""

    names: tuple[str, ...]
    run: Callable[[], list[Result]]
    unmet: str = ""

    def skipped(self, reason: str) -> list[Result]:
        return [Result(name, "skip", reason=reason) for name in self.names]

    def crashed(self, crash: Exception) -> list[Result]:
        reason = f"crashed: {type(crash).__name__}: {crash}"
        return [Result(name, "fail", reason=reason) for name in self.names]

    def results(self) -> list[Result]:
        """Its rows: run, or skipped if ``unmet``."""
        return self.skipped(self.unmet) if self.unmet else self.run()


def run_tasks(tasks: list[Task]) -> list[Result]:
    """Every task's rows, in order."""
    return [row for task in tasks for row in task.results()]


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norms, float64; the
    difference's norm when ``expected`` is 0).

    Norm-wise rather than element-wise: low-precision rounding errors are
    spread over all entries, so the bound reflects the precision, not the
    single unluckiest element.
    """
    actual, expected = actual.detach().double(), expected.detach().double().to(actual.device)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


def worst(errors) -> float:
    """The largest error; NaN if any is NaN (``max`` would depend on the order)."""
    errors = list(errors)
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.2e}"
    if isinstance(value, list):
        return "[" + " ".join(_format_value(v) for v in value) + "]"
    return str(value)


def format_table(results: list[Result]) -> str:
    """A fixed-width table: check, status, measured numbers, reason."""
    rows = [("check", "status", "measured", "reason")]
    for r in results:
        measured = ", ".join(f"{k}={_format_value(v)}" for k, v in r.measured.items())
        rows.append((r.name, r.status.upper(), measured, r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(line.rstrip() for line in lines)

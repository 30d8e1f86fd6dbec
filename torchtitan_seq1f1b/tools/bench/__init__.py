# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Real CPU benchmark of pipeline schedules: step time, bubble, activation memory.

Every row trains the same small causal transformer on ``pp`` local gloo
ranks, one CPU thread each, against torch's ``Schedule1F1B`` and the
simulator's prediction. Run ``python -m torchtitan_seq1f1b.bench --help``;
what each number measures and how is in ``docs/benchmarks.md``.
"""

from torchtitan_seq1f1b.tools.bench.cli import main
from torchtitan_seq1f1b.tools.bench.config import (
    BenchConfig,
    BenchPreset,
    BenchRow,
    FULL_PRESET,
    plan_rows,
    QUICK_PRESET,
)
from torchtitan_seq1f1b.tools.bench.predict import memory_model, predict
from torchtitan_seq1f1b.tools.bench.runner import run_bench
from torchtitan_seq1f1b.tools.bench.schedules import BenchSchedule, SCHEDULES
from torchtitan_seq1f1b.tools.bench.table import print_table

__all__ = [
    "BenchConfig",
    "BenchPreset",
    "BenchRow",
    "BenchSchedule",
    "FULL_PRESET",
    "QUICK_PRESET",
    "SCHEDULES",
    "main",
    "memory_model",
    "plan_rows",
    "predict",
    "print_table",
    "run_bench",
]

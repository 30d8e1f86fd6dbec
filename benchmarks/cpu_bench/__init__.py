# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Real CPU benchmark of pipeline schedules: step time, bubble, activation memory.

Every row trains the same small causal transformer on ``pp`` local gloo
ranks, one CPU thread each, against torch's ``Schedule1F1B`` and the
simulator's prediction. Run ``python -m benchmarks.cpu_bench --help``;
what each number measures and how is in ``docs/benchmarks.md``.
"""

from benchmarks.cpu_bench.cli import main
from benchmarks.cpu_bench.config import (
    BenchConfig,
    BenchPreset,
    BenchRow,
    FULL_PRESET,
    plan_rows,
    QUICK_PRESET,
)
from benchmarks.cpu_bench.predict import predict
from benchmarks.cpu_bench.runner import run_bench
from benchmarks.cpu_bench.schedules import BenchSchedule, SCHEDULES
from benchmarks.cpu_bench.table import print_table

__all__ = [
    "BenchConfig",
    "BenchPreset",
    "BenchRow",
    "BenchSchedule",
    "FULL_PRESET",
    "QUICK_PRESET",
    "SCHEDULES",
    "main",
    "plan_rows",
    "predict",
    "print_table",
    "run_bench",
]

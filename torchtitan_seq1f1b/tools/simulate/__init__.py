# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline timeline and memory simulator for Seq1F1B and torch's schedules.

It replays the exact per-rank action orders the real schedules execute and
reports makespan, bubble fraction and per-rank peak memory; ``--paper``
compares the memory model with the Seq1F1B paper's published figure. Run
``python -m torchtitan_seq1f1b.simulate --help``. The timeline and memory
models, and how the paper's layouts were inferred: docs/simulator.md.
"""

from torchtitan_seq1f1b.tools.simulate.cli import (
    add_context_parallel_arguments,
    add_model_arguments,
    main,
    model_from_args,
    number_at_least,
    positive_float,
    positive_int,
    write_json,
)
from torchtitan_seq1f1b.tools.simulate.config import (
    MemoryModel,
    runtime_memory_model,
    schedule_order,
    SimConfig,
)
from torchtitan_seq1f1b.tools.simulate.paper import PAPER_CONFIGS, PaperConfig, run_paper
from torchtitan_seq1f1b.tools.simulate.schedules import (
    analytic_bubble,
    SCHEDULE_SPECS,
    SCHEDULES,
    ScheduleSpec,
)
from torchtitan_seq1f1b.tools.simulate.step import activation_peaks, RankReport, SimResult, simulate
from torchtitan_seq1f1b.tools.simulate.unit_times import action_duration, unit_times

__all__ = [
    "activation_peaks",
    "runtime_memory_model",
    "PAPER_CONFIGS",
    "MemoryModel",
    "PaperConfig",
    "RankReport",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "ScheduleSpec",
    "SimConfig",
    "SimResult",
    "action_duration",
    "add_context_parallel_arguments",
    "add_model_arguments",
    "analytic_bubble",
    "main",
    "model_from_args",
    "number_at_least",
    "positive_float",
    "positive_int",
    "run_paper",
    "schedule_order",
    "simulate",
    "unit_times",
    "write_json",
]

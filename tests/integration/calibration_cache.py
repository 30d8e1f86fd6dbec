# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Jobs that leave the plan to the planner, made deterministic: a time model written into the
calibration cache before the job starts, and the plan :func:`recommend` picks from it in-process.

The job finds the cache through ``$SEQ1F1B_CALIBRATION_CACHE`` and reads it
instead of timing the model, when the file's key is the one the job computes:
the model's dims, ``training.seq_len``, the device with the thread count the
torchrun harness gives every process (``OMP_NUM_THREADS=1``), the compute
dtype, the microbatch size, the attention backend, the blocks a pipeline rank
holds and torch's version. A
mismatch makes the job measure instead and log "measured, saved to": the
tests assert "read from".
"""

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.planner.auto import AutoPlanRequest, recommend_for
from torchtitan_seq1f1b.planner.calibrate import (
    CACHE_ENV,
    cached_calibration,
    CalibrationTarget,
    chain_within,
    rank_chain_length,
)
from torchtitan_seq1f1b.planner.choose import PARTITIONS, Recommendation
from torchtitan_seq1f1b.planner.time_model import RuntimeOverhead, TimeModel, UnitTime
from torchtitan_seq1f1b.segmenting import TransformerCost

from tests.harness import JOB_ROWS, JOB_TOKENS

__all__ = [
    "TIME_MODEL",
    "TORCHRUN_THREADS",
    "expected_recommendation",
    "planner_job_target",
    "write_calibration",
]

# The module (the package exports its function ``calibrate`` under the same name).
_calibrate_module = importlib.import_module("torchtitan_seq1f1b.planner.calibrate")

TORCHRUN_THREADS = 1  # tests.harness.torchrun sets OMP_NUM_THREADS=1

# Made up, not measured: attention-heavy segments (per_pair) against a per-unit
# overhead that makes very many short segments slow, so the fastest plan has a
# few segments cut by the "time" partition, unlike "balanced" (FLOPs) cuts; the runtime's
# cost per action is charged as the job's planner charges it.
_BLOCK_F = UnitTime(per_token=1e-6, per_pair=2e-7, per_unit=2e-5)
TIME_MODEL = TimeModel(
    block={
        "F": _BLOCK_F,
        "B": UnitTime(2 * _BLOCK_F.per_token, 2.5 * _BLOCK_F.per_pair, 2 * _BLOCK_F.per_unit),
        "I": UnitTime(_BLOCK_F.per_token, 1.5 * _BLOCK_F.per_pair, _BLOCK_F.per_unit),
        "W": UnitTime(_BLOCK_F.per_token, _BLOCK_F.per_pair, _BLOCK_F.per_unit),
    },
    head={
        "F": UnitTime(6e-6, 0.0, 1e-5),
        "B": UnitTime(1.2e-5, 0.0, 2e-5),
        "I": UnitTime(6e-6, 0.0, 1e-5),
        "W": UnitTime(6e-6, 0.0, 1e-5),
    },
    block_activation_bytes=16384.0,
    head_activation_bytes=65536.0,
    kv_bytes=2048.0,
    kv_grad_bytes=2048.0,
    runtime=RuntimeOverhead(per_action=2e-5, per_token=1e-8, per_step=1e-3),
)


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def planner_job_target(cost: TransformerCost, budget_bytes: int | None = None) -> CalibrationTarget:
    """What the tests' planner jobs calibrate: ``cost`` at the test job's tokens in float32
    on CPU (no FSDP), its microbatch rows, backend "auto", chained as deep as one of 2
    ranks and ``budget_bytes`` allow."""
    target = CalibrationTarget(
        shape=cost,
        seq_len=JOB_TOKENS,
        device="cpu",
        dtype=torch.float32,
        microbatch_size=JOB_ROWS,
        chained_blocks=rank_chain_length(cost.n_layers, 2),
    )
    return chain_within(target, budget_bytes)


def write_calibration(
    folder: Path, target: CalibrationTarget, model: TimeModel = TIME_MODEL
) -> Path:
    """Put ``model`` in the cache at ``folder`` as the calibration of ``target`` run under torchrun.

    The planner's own cache writes it (``calibrate`` replaced), so the file's
    name and key are whatever the job will look up.
    """
    with (
        _threads(TORCHRUN_THREADS),
        mock.patch.dict(os.environ, {CACHE_ENV: str(folder)}),
        mock.patch.object(
            _calibrate_module,
            "calibrate",
            lambda t, probes: dataclasses.replace(
                model, calibrated_for=_calibrate_module._measured_for(t, probes)
            ),
        ),
    ):
        _, path, _ = cached_calibration(target, refresh=True)
    assert path.parent == folder
    return path


def expected_recommendation(
    cost: TransformerCost,
    seq_len: int,
    schedule: str,
    num_ranks: int,
    stages_per_rank: int,
    microbatches: int,
    budget_bytes: int | None,
    model: TimeModel = TIME_MODEL,
    partitions: tuple[str, ...] = PARTITIONS,
) -> Recommendation:
    """What the planner must choose for such a job, computed here from ``model`` directly."""
    request = AutoPlanRequest(
        shape=cost,
        seq_len=seq_len,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        order_for=SCHEDULES[schedule].schedule_class.order_for,
        budget_bytes=budget_bytes,
        partitions=partitions,
    )
    return recommend_for(request, model)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The planner's path through ``plan_segments``, whichever torchtitan is installed.

Rank 0 chooses and every rank hears its choice or its failure: a failing
calibration must reach the other ranks as an error, not leave them waiting.
"""

import time

import pytest
import torch

from torchtitan_seq1f1b.local_ranks import run_ranks
from torchtitan_seq1f1b.integration import segment_plan as integration_plan
from torchtitan_seq1f1b.integration.options import KERNEL_TILE, Seq1F1BOptions
from torchtitan_seq1f1b.integration.segment_plan import PlannerJob, plan_segments, Seq1F1BConfigError
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B
from torchtitan_seq1f1b.segmenting import TransformerCost

SHAPE = TransformerCost(
    n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=64
)
AUTO = Seq1F1BOptions(num_segments="auto", partition="auto", memory_budget_gib=1.0)
GROUP_TIMEOUT = 3  # seconds a collective waits


def _job() -> PlannerJob:
    return PlannerJob(
        num_ranks=2, stages_per_rank=1, microbatches=2, order_for=ScheduleSeq1F1B.order_for,
        device=torch.device("cpu"), dtype=torch.float32, microbatch_size=1, parameters=10_000,
    )


def _failing_calibration(request):
    raise RuntimeError("CUDA out of memory")


def test_the_planner_needs_the_jobs_layout():
    with pytest.raises(Seq1F1BConfigError, match="the planner needs the job's layout"):
        plan_segments(AUTO, 64, 1, SHAPE)


def test_a_failing_calibration_is_a_config_error(monkeypatch):
    monkeypatch.setattr(integration_plan, "plan_automatically", _failing_calibration)
    with pytest.raises(
        Seq1F1BConfigError,
        match="seq1f1b.num_segments='auto'.*planner failed on rank 0: RuntimeError: CUDA out of",
    ):
        plan_segments(AUTO, 64, 1, SHAPE, _job(), log=lambda line: None)


def test_a_context_parallel_job_plans_with_its_degree(monkeypatch):
    """The request carries the CP degree; its lengths are multiples of tp x 2 * cp."""
    requests = []

    def recording(request):
        requests.append(request)
        return planned(request)

    planned = integration_plan.plan_automatically
    monkeypatch.setattr(integration_plan, "plan_automatically", recording)
    plan = plan_segments(AUTO, 64, 2, SHAPE, _job(), log=lambda line: None, cp=2)
    (request,) = requests
    assert (request.context_parallel, request.align) == (2, 8)
    assert sum(plan.lengths) == 64 and all(n % 8 == 0 for n in plan.lengths)


def _plan_on_rank(rank: int, world_size: int, fail: bool) -> str:
    if fail and rank == 0:
        integration_plan.plan_automatically = _failing_calibration
    try:
        return str(plan_segments(AUTO, 64, 1, SHAPE, _job(), log=lambda line: None).lengths)
    except Seq1F1BConfigError as error:
        return f"error: {error}"


def test_every_rank_gets_rank_0s_plan_or_its_failure():
    planned = run_ranks(_plan_on_rank, 2, False, timeout=120)
    assert planned[0] == planned[1] and not planned[0].startswith("error")
    failed = run_ranks(_plan_on_rank, 2, True, timeout=120)
    assert failed[0] == failed[1]
    assert "planner failed on rank 0: RuntimeError: CUDA out of memory" in failed[1]


def _plan_slowly(rank: int, world_size: int) -> str:
    if rank == 0:
        choose = integration_plan.plan_automatically

        def slow(request):
            time.sleep(2 * GROUP_TIMEOUT)  # calibrating a long sequence
            return choose(request)

        integration_plan.plan_automatically = slow
    return _plan_on_rank(rank, world_size, fail=False)


def test_the_other_ranks_outwait_a_collective_timeout():
    planned = run_ranks(_plan_slowly, 2, timeout=120, group_timeout=GROUP_TIMEOUT)
    assert planned[0] == planned[1] and not planned[0].startswith("error")


def test_segments_align_to_the_kernel_tile_on_cuda_by_default():
    options = Seq1F1BOptions(num_segments=4)
    assert options.segment_align(1, 32768, on_cuda=True) == KERNEL_TILE
    assert options.segment_align(2, 32768, on_cuda=True) == KERNEL_TILE
    assert options.segment_align(3, 32768, on_cuda=True) == 3 * KERNEL_TILE
    assert options.segment_align(1, 32768, on_cuda=False) == 1
    # a sequence that does not hold k tiles, or is no multiple of one, keeps 1
    assert options.segment_align(1, 4 * KERNEL_TILE - 8, on_cuda=True) == 1
    assert options.segment_align(1, 3 * KERNEL_TILE, on_cuda=True) == 1
    assert Seq1F1BOptions(align=8).segment_align(2, 32768, on_cuda=True) == 8
    with pytest.raises(ValueError, match="seq1f1b.align=-1 must be an integer >= 0"):
        Seq1F1BOptions(align=-1).segment_align(1, 32768, on_cuda=True)


def test_the_default_plan_on_cuda_is_in_kernel_tiles(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = plan_segments(Seq1F1BOptions(num_segments=4), 32768, 1, SHAPE)
    assert all(n % KERNEL_TILE == 0 for n in plan.lengths)
    with pytest.raises(Seq1F1BConfigError, match="seq1f1b.align=-2 must be"):
        plan_segments(Seq1F1BOptions(align=-2), 32768, 1, SHAPE)

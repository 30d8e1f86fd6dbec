# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Receives posted when the step starts on CPU (gloo), torch's placement on CUDA.

The exactness tests run every schedule with the CPU placement; here: the
move keeps every channel's messages matched, and the runtime picks it by device.
"""

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)
from torchtitan_seq1f1b._torch_compat import _add_send_recv
from torchtitan_seq1f1b.examples.tiny_transformer import token_sum_cross_entropy
from torchtitan_seq1f1b.orders import lower_order
from torchtitan_seq1f1b.orders.validate import _check_channels_fifo
from torchtitan_seq1f1b.stepping.receives import receives_first

from tests.harness import Case, run_ranks


def _is_receive(action) -> bool:
    return action.computation_type.value in ("RECV_F", "RECV_B")


@pytest.mark.parametrize(
    "schedule,stages_per_rank",
    [
        (ScheduleSeq1F1B, 1),
        (ScheduleSeq1F1BZeroBubble, 1),
        (ScheduleInterleavedSeq1F1B, 2),
        (ScheduleSeq1F1BZBV, 2),
    ],
)
def test_receives_move_ahead_in_order_and_every_channel_still_matches(schedule, stages_per_rank):
    num_ranks, k = 3, 3
    order = schedule.order_for(num_ranks, stages_per_rank, 4, k)
    rank_of = {a.stage: rank for rank, actions in order.items() for a in actions}
    lowered = _add_send_recv(lower_order(order, k), rank_of.__getitem__, len(rank_of))
    moved = receives_first(lowered)
    for rank, actions in lowered.items():
        receives = [a for a in actions if _is_receive(a)]
        assert receives, "every rank receives something in a pipeline of 3 ranks"
        assert moved[rank][: len(receives)] == receives
        assert moved[rank][len(receives):] == [a for a in actions if not _is_receive(a)]
    _check_channels_fifo(moved, rank_of.__getitem__)


def test_a_receive_out_of_channel_order_would_be_caught():
    """The check above can fail: swapping two receives of one channel breaks it."""
    order = ScheduleSeq1F1B.order_for(2, 1, 2, 2)
    lowered = _add_send_recv(lower_order(order, 2), lambda stage: stage, 2)
    moved = receives_first(lowered)
    moved[1][0], moved[1][1] = moved[1][1], moved[1][0]
    with pytest.raises(Exception, match="posts receives from rank 0 in the order"):
        _check_channels_fifo(moved, lambda stage: stage)


def _placements(rank, world_size):
    case = Case(n_microbatches=2, lengths=(6, 4, 2))
    stage = PipelineStage(
        case.model().stage(rank, world_size), rank, world_size, torch.device("cpu")
    )
    schedule = ScheduleSeq1F1B(
        stage, n_microbatches=2, segment_plan=case.plan, loss_fn=token_sum_cross_entropy
    )
    trained = schedule._train_order_with_comms[rank]
    count = sum(map(_is_receive, trained))
    on_cpu = all(map(_is_receive, trained[:count]))
    lowered = {rank: list(reversed(trained))}  # receives last: would the runtime move them?
    stage.device = torch.device("cuda")  # only read by the placement policy here
    on_cuda = schedule._place_receives(lowered) is lowered
    return count, on_cpu, on_cuda


def test_the_runtime_posts_receives_first_on_cpu_and_keeps_torchs_placement_on_cuda():
    for count, on_cpu, on_cuda in run_ranks(_placements, 2, timeout=120):
        assert count == 2 * 3  # one receive per unit: 2 microbatches x 3 segments
        assert on_cpu and on_cuda

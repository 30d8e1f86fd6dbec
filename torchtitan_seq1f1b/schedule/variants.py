# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The Seq1F1B variants: interleaved, zero-bubble (ZB-H1 style) and the V (ZB-V style).

Each is :class:`ScheduleSeq1F1B` with its own stage layout and compute order;
the runtime, segment handling and K/V routing are shared.
"""

from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.orders import (
    interleaved_seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    v_stage_to_rank,
)
from torchtitan_seq1f1b.schedule.runtime import ScheduleSeq1F1B
from torchtitan_seq1f1b.schedule.stage_layout import (
    check_loop_placement,
    check_one_stage_per_rank,
    check_v_placement,
)

__all__ = ["ScheduleInterleavedSeq1F1B", "ScheduleSeq1F1BZBV", "ScheduleSeq1F1BZeroBubble"]


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """Seq1F1B with several stages (model chunks) per rank, loop placement.

    Rank r holds stages ``r, r + p, ..., r + (v-1)*p``, as for torch's
    ``ScheduleInterleaved1F1B``, and runs interleaved 1F1B over the m*k units
    (:func:`~torchtitan_seq1f1b.orders.interleaved_seq1f1b_order`). The bubble
    shrinks to ``(p-1)/(v*m*k + p-1)``; rank 0 holds about
    ``((v+1)*p + k - 2) / (v*k)`` microbatches of activations. Any m and k
    work; with k = 1 the order is torch's Interleaved1F1B order.

    Takes the same arguments as :class:`ScheduleSeq1F1B`, with ``stages`` the
    list of this rank's v >= 2 stages.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_loop_placement(stages, "ScheduleInterleavedSeq1F1B")

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return interleaved_seq1f1b_order(num_ranks, stages_per_rank, n_microbatches, num_segments)


class ScheduleSeq1F1BZeroBubble(ScheduleSeq1F1B):
    """Seq1F1B with split backwards, ZB-H1 style; one stage per rank.

    Every unit's backward runs as an input-gradient step (I, what the previous
    stage waits for) and a weight-gradient step (W). Rank r defers its W steps
    by r, so they fill the cooldown where a later rank would idle, while no
    rank holds more units awaiting W than Seq1F1B's rank 0 holds awaiting
    backward (p + k - 1). The bubble drops to roughly a third of Seq1F1B's
    when I and W cost about a forward each
    (:func:`~torchtitan_seq1f1b.orders.seq1f1b_zero_bubble_order`).

    On the first stage torch computes the whole backward in the W step (its
    inputs are tokens), so W steps of a microbatch run last segment first, as
    the K/V gradient routing needs; I steps on other stages carry the K/V
    prefix gradients, and W steps only read the banked activation gradients.
    Takes the same arguments as :class:`ScheduleSeq1F1B`.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_one_stage_per_rank(stages, "ScheduleSeq1F1BZeroBubble")

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return seq1f1b_zero_bubble_order(
            num_ranks * stages_per_rank, n_microbatches, num_segments
        )


class ScheduleSeq1F1BZBV(ScheduleSeq1F1B):
    """Seq1F1B with split backwards on a V of two stages per rank (ZB-V style).

    Rank r holds stages r and 2p-1-r, as for torch's ``ScheduleZBVZeroBubble``
    (build the stages with that placement). Units run down the ranks on the
    first chunk and back up on the second, in ZB-V's warmup/steady/cooldown
    pattern with the second chunk's forwards ``r + k - 1`` units ahead of its
    input gradients; at most ``2 * (p + k - 1)`` half-stage units await their
    weight gradient (Seq1F1B's rank-0 activation memory)
    (:func:`~torchtitan_seq1f1b.orders.seq1f1b_zbv_order`). With k = 1 it
    runs torch's ZBVZeroBubble order. Any m and k work. Takes the same
    arguments as :class:`ScheduleSeq1F1B`, with ``stages`` this rank's two
    stages.
    """

    @staticmethod
    def _check_stage_layout(stages: list[_PipelineStageBase]) -> None:
        check_v_placement(stages, "ScheduleSeq1F1BZBV")

    def _place_stages(self) -> None:
        place = v_stage_to_rank(self.pp_group_size)
        self.stage_index_to_group_rank = {s: place(s) for s in range(self._num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    @classmethod
    def order_for(
        cls, num_ranks: int, stages_per_rank: int, n_microbatches: int, num_segments: int
    ) -> Order:
        return seq1f1b_zbv_order(num_ranks, n_microbatches, num_segments)

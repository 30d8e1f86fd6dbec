# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B per-rank compute orders, the checker every order must pass, and their replay.

On every stage, forwards run in unit order (0,0), (0,1), ..., (m-1,k-1) and
backwards are FIFO over microbatches and LIFO over segments, since segment
j's K/V gradients come from segments j+1..k-1.
"""

from torchtitan_seq1f1b.orders.one_f_one_b import (
    gpipe_order,
    interleaved_seq1f1b_order,
    seq1f1b_order,
)
from torchtitan_seq1f1b.orders.timeline import equal_cost_bubble, replay, Timeline
from torchtitan_seq1f1b.orders.validate import lower_order, ScheduleOrderError, validate_order
from torchtitan_seq1f1b.orders.zero_bubble import (
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    v_stage_to_rank,
)

__all__ = [
    "ScheduleOrderError",
    "Timeline",
    "equal_cost_bubble",
    "gpipe_order",
    "interleaved_seq1f1b_order",
    "lower_order",
    "replay",
    "seq1f1b_order",
    "seq1f1b_zbv_order",
    "seq1f1b_zero_bubble_order",
    "v_stage_to_rank",
    "validate_order",
]

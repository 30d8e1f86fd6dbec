# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B (sequence-level 1F1B pipeline parallelism) for torchtitan.

Imported inside a torchtitan job (``[experimental] custom_import =
"torchtitan_seq1f1b"``), the package also registers the "Seq1F1B" pipeline
schedule with torchtitan; see :mod:`torchtitan_seq1f1b.integration`.
"""

import sys

from torchtitan_seq1f1b.actions import SegmentAction
from torchtitan_seq1f1b.attention import SegmentAwareAttention, wrap_attention
from torchtitan_seq1f1b.orders import (
    interleaved_seq1f1b_order,
    ScheduleOrderError,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    validate_order,
)
from torchtitan_seq1f1b.schedules import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleOrderError",
    "ScheduleSeq1F1B",
    "ScheduleSeq1F1BZBV",
    "ScheduleSeq1F1BZeroBubble",
    "SegmentAction",
    "SegmentAwareAttention",
    "SegmentPlan",
    "TransformerCost",
    "interleaved_seq1f1b_order",
    "seq1f1b_order",
    "seq1f1b_zbv_order",
    "seq1f1b_zero_bubble_order",
    "validate_order",
    "wrap_attention",
]

# Only inside a torchtitan process: the core needs no torchtitan import.
if "torchtitan" in sys.modules:
    from torchtitan_seq1f1b.integration import install

    install()

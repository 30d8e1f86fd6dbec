# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The Seq1F1B schedule names a torchtitan job can select, whichever torchtitan it is.

Each name maps to its schedule class and to the torch schedule with the same
stage layout, which torchtitan's model splitting and stage-count rules know.
"""

from dataclasses import dataclass

from torchtitan_seq1f1b.schedules import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)

__all__ = ["SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "ScheduleEntry"]


@dataclass(frozen=True)
class ScheduleEntry:
    schedule_class: type[ScheduleSeq1F1B]
    # A torch schedule with the same stage layout, for pipeline_module_split
    # (loop or V placement) and for torchtitan's stage-count rules.
    layout_of: str
    min_stages_per_rank: int = 1
    max_stages_per_rank: int | None = 1


SCHEDULES = {
    "Seq1F1B": ScheduleEntry(ScheduleSeq1F1B, "1F1B"),
    "InterleavedSeq1F1B": ScheduleEntry(
        ScheduleInterleavedSeq1F1B, "Interleaved1F1B", 2, None
    ),
    "Seq1F1BZeroBubble": ScheduleEntry(ScheduleSeq1F1BZeroBubble, "1F1B"),
    "Seq1F1BZBV": ScheduleEntry(ScheduleSeq1F1BZBV, "ZBVZeroBubble", 2, 2),
}


# Schedules whose backward runs as an input-gradient and a weight-gradient step.
SPLIT_BACKWARD_SCHEDULES = ("Seq1F1BZeroBubble", "Seq1F1BZBV")

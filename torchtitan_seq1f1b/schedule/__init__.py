# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B schedules: pipelines over (microbatch, sequence segment) units.

- :class:`ScheduleSeq1F1B` (:mod:`.runtime`): one stage per rank, 1F1B over units.
- :class:`ScheduleInterleavedSeq1F1B`: several stages per rank (loop
  placement), interleaved 1F1B over units.
- :class:`ScheduleSeq1F1BZeroBubble`: one stage per rank, every backward split
  into input- and weight-gradient steps, weight gradients deferred into the
  bubbles (ZB-H1 style).
- :class:`ScheduleSeq1F1BZBV`: two stages per rank in a V, split backwards
  (ZB-V style).

The runtime's parts: :mod:`.segment_inputs` cuts inputs into units and merges
outputs, :mod:`.unit_compute` surrounds every compute call of a unit,
:mod:`.stage_layout` checks arguments and placement, :mod:`.rank_errors`
raises an input error on every rank that must know it.
"""

from torchtitan_seq1f1b.schedule.runtime import ScheduleSeq1F1B
from torchtitan_seq1f1b.schedule.variants import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
)

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "ScheduleSeq1F1BZBV",
    "ScheduleSeq1F1BZeroBubble",
]

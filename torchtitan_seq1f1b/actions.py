# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The sequence-segmented action: one compute step on one unit.

A unit is segment j of microbatch i, ``Unit(i, j)``: what Seq1F1B pipelines.
torch's runtime actions carry only (stage, type, microbatch), and its lowering
passes rebuild actions from exactly those fields. A unit is therefore lowered
to torch's microbatch index ``i * num_segments + j``, which torch's stages call
the *chunk id*: every pass (send/recv insertion, FSDP unshard/reshard, grad
reduction, the dI/dW split) keeps working unchanged.
"""

import re
from dataclasses import dataclass
from typing import NamedTuple

from torchtitan_seq1f1b._torch_compat import _Action, _ComputationType

__all__ = ["Order", "SegmentAction", "Unit"]

_KINDS = {
    "F": _ComputationType.FORWARD,
    "B": _ComputationType.FULL_BACKWARD,
    "I": _ComputationType.BACKWARD_INPUT,
    "W": _ComputationType.BACKWARD_WEIGHT,
}
_PATTERN = re.compile(r"^(\d+)([FBIW])(\d+)\.(\d+)$")


class Unit(NamedTuple):
    """Segment ``segment`` of microbatch ``microbatch``: one unit of pipelined work."""

    microbatch: int
    segment: int

    def chunk_id(self, num_segments: int) -> int:
        """torch's microbatch index for this unit (its stages' ``chunk_id``)."""
        return self.microbatch * num_segments + self.segment

    @staticmethod
    def of_chunk(chunk_id: int, num_segments: int) -> "Unit":
        return Unit(*divmod(chunk_id, num_segments))


@dataclass(frozen=True, slots=True)
class SegmentAction:
    """Compute ``kind`` for segment ``segment`` of microbatch ``microbatch`` on ``stage``.

    ``kind`` is "F" (forward), "B" (full backward), "I" (input gradient) or
    "W" (weight gradient). The string form is ``{stage}{kind}{microbatch}.{segment}``,
    e.g. ``0F1.2``.
    """

    stage: int
    kind: str
    microbatch: int
    segment: int

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {sorted(_KINDS)}")
        if min(self.stage, self.microbatch, self.segment) < 0:
            raise ValueError(f"{self!r}: indices must be non-negative")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}.{self.segment}"

    @property
    def unit(self) -> Unit:
        return Unit(self.microbatch, self.segment)

    @staticmethod
    def from_str(text: str) -> "SegmentAction":
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"{text!r} is not a segment action; expected e.g. '0F1.2' "
                "(stage, kind F/B/I/W, microbatch, '.', segment)"
            )
        stage, kind, microbatch, segment = match.groups()
        return SegmentAction(int(stage), kind, int(microbatch), int(segment))

    def lower(self, num_segments: int) -> _Action:
        """The torch runtime action for this unit's chunk id."""
        if self.segment >= num_segments:
            raise ValueError(f"{self}: segment out of range for {num_segments} segments")
        return _Action(self.stage, _KINDS[self.kind], self.unit.chunk_id(num_segments))

    @staticmethod
    def from_action(action: _Action, num_segments: int) -> "SegmentAction":
        """Inverse of :meth:`lower` for compute actions."""
        kind = next(
            (k for k, t in _KINDS.items() if t == action.computation_type), None
        )
        if kind is None or action.microbatch_index is None:
            raise ValueError(f"{action} is not a per-unit compute action")
        return SegmentAction(
            action.stage_index, kind, *Unit.of_chunk(action.microbatch_index, num_segments)
        )


Order = dict[int, list[SegmentAction]]
"""Per rank, the compute actions it runs, in order."""

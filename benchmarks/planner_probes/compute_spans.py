# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""When each compute call of a pipeline stage runs, recorded inside real steps.

The planner times units in short pipeline steps with it
(:mod:`.pipeline_units`); the benchmark draws real-run timelines from it.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["ComputeRecorder", "ComputeSpan"]


@dataclass(frozen=True)
class ComputeSpan:
    """One compute call of a stage: kind "F", "B" (full backward), "I" or "W"."""

    stage: int
    kind: str
    chunk: int
    start: float
    end: float


class ComputeRecorder:
    """Record when each of ``stages`` runs forward/backward compute (``time.perf_counter``).

    Wraps the stages' ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk``, where every torch schedule's compute ends,
    on top of any wrapper already there (Seq1F1B's unit scope), and restores
    them on exit. ``chunk`` is torch's microbatch index (a Seq1F1B unit's chunk id).
    """

    _METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: Sequence[_PipelineStageBase]):
        self._stages = list(stages)
        self.spans: list[ComputeSpan] = []
        self._saved: list[tuple[_PipelineStageBase, str, object]] = []

    def __enter__(self) -> "ComputeRecorder":
        for stage in self._stages:
            for name in self._METHODS:
                # None: the class's method was in use; restored by deleting ours.
                self._saved.append((stage, name, stage.__dict__.get(name)))
                setattr(stage, name, self._timed(stage, name, getattr(stage, name)))
        return self

    def __exit__(self, *exc_info) -> None:
        for stage, name, previous in reversed(self._saved):
            if previous is None:
                delattr(stage, name)
            else:
                setattr(stage, name, previous)
        self._saved.clear()

    def _timed(self, stage: _PipelineStageBase, name: str, method):
        def timed(chunk_id, *args, **kwargs):
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:
                kind = "B" if kwargs.get("full_backward", True) else "I"
            start = time.perf_counter()
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                self.spans.append(
                    ComputeSpan(stage.stage_index, kind, chunk_id, start, time.perf_counter())
                )

        return timed

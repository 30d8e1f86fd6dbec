# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The stage's compute entry points, alike in every tested torch (2.11-2.15)."""

import contextlib
from collections.abc import Callable

from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["wrap_stage_compute"]


UnitScope = Callable[[_PipelineStageBase, int, str], contextlib.AbstractContextManager]


def wrap_stage_compute(stage: _PipelineStageBase, scope: UnitScope) -> None:
    """Run every compute call of ``stage`` inside ``scope(stage, chunk_id, kind)``.

    Every schedule path ends in the stage's ``forward_one_chunk`` /
    ``backward_one_chunk`` / ``backward_weight_one_chunk``; wrapping them is
    the one place where the running (microbatch, segment) unit is known for
    forwards, backwards, weight-gradient steps and activation-checkpoint
    recomputation alike. ``kind`` is "F", "B" (full backward), "I" or "W".
    Re-wrapping a stage only replaces the scope.
    """
    if getattr(stage, "_seq1f1b_scope", None) is None:
        forward = stage.forward_one_chunk
        backward = stage.backward_one_chunk
        backward_weight = stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            with stage._seq1f1b_scope(stage, fwd_chunk_id, "F"):
                return forward(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(bwd_chunk_id, *args, full_backward=True, **kwargs):
            kind = "B" if full_backward else "I"
            with stage._seq1f1b_scope(stage, bwd_chunk_id, kind):
                return backward(
                    bwd_chunk_id, *args, full_backward=full_backward, **kwargs
                )

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
            with stage._seq1f1b_scope(stage, bwd_chunk_id, "W"):
                return backward_weight(bwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
    stage._seq1f1b_scope = scope

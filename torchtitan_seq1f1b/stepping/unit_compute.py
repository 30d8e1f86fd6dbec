# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What surrounds every compute call of a unit on a stage.

torch's stages run every forward, backward, weight-gradient step and
checkpoint recompute through three methods; the schedule wraps them
(:func:`~torchtitan_seq1f1b._torch_compat.wrap_stage_compute`) with
:class:`UnitComputeScope`, which

- tells the stage's K/V store which unit is running (and its microbatch's
  packed documents), so attention finds its prefix on whichever thread
  autograd runs it;
- turns off torch's per-chunk shape validation when segments differ in length;
- checks after a forward that the stage's outputs keep their segment's tokens;
- frees a microbatch's K/V once its last unit's backward (or, without
  backward, its last forward) has run.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b._torch_compat import runtime_validation_disabled, stage_outputs
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.context_parallel import ContextGroup
from torchtitan_seq1f1b.documents import MicrobatchDocuments
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import scaled_seq_len, SegmentPlan

__all__ = ["UnitComputeScope"]


class UnitComputeScope:
    """``scope(stage, chunk_id, kind)``: the context of one compute call.

    Args:
        plan: the schedule's segment plan.
        kv_stores: the K/V store of every stage on this rank, by stage index.
        seq_dim: sequence dim of stage outputs.
        context: this rank's CP group, None without context parallelism.
    """

    def __init__(
        self,
        plan: SegmentPlan,
        kv_stores: dict[int, KVStore],
        seq_dim: int,
        context: ContextGroup | None = None,
    ):
        self.plan = plan
        self.kv_stores = kv_stores
        self.seq_dim = seq_dim
        self.context = context
        # This step's packed documents, one per microbatch; None for causal attention.
        self.documents: list[MicrobatchDocuments] | None = None
        self._uneven = len(set(plan.lengths)) > 1
        self._reference_output_lens: dict[int, list[int]] = {}

    @contextlib.contextmanager
    def __call__(self, stage: _PipelineStageBase, chunk_id: int, kind: str) -> Iterator[None]:
        unit = Unit.of_chunk(chunk_id, self.plan.num_segments)
        store = self.kv_stores[stage.stage_index]
        validation = (
            runtime_validation_disabled(stage) if self._uneven else contextlib.nullcontext()
        )
        documents = None if self.documents is None else self.documents[unit.microbatch]
        running = RunningUnit(unit, self.plan, documents, self.context)
        with store.running_unit(running), validation:
            yield
        if kind == "F" and not stage.is_last:
            self._check_outputs(stage, chunk_id, unit.segment)
        last_of_microbatch = (kind in ("B", "W") and unit.segment == 0) or (
            kind == "F" and not stage.has_backward and unit.segment == self.plan.num_segments - 1
        )
        if last_of_microbatch:
            store.free(unit.microbatch)

    def _check_outputs(self, stage: _PipelineStageBase, chunk_id: int, segment: int) -> None:
        """Every output must hold its segment's tokens the way chunk 0's held its own.

        Receive buffers are sized from that ratio (1, or 1/tp for plain local
        tensors under sequence parallel), so a stage that changes it would
        corrupt the next stage's input.
        """
        outputs = stage_outputs(stage, chunk_id)
        lens = [o.shape[self.seq_dim] for o in outputs if isinstance(o, torch.Tensor)]
        if chunk_id == 0:
            self._reference_output_lens[stage.stage_index] = lens
        tokens = self.plan.lengths
        for length, reference in zip(lens, self._reference_output_lens[stage.stage_index]):
            expected = scaled_seq_len(reference, tokens[0], tokens[segment])
            if length != expected:
                raise ValueError(
                    f"stage {stage.stage_index} produced an output with {length} entries "
                    f"on dim seq_dim={self.seq_dim} for segment {segment} of "
                    f"{self.plan}, expected {expected}; stage outputs must "
                    "keep their segment's tokens on seq_dim"
                )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Raising one rank's input error on every rank of the pipeline.

Only the first stage sees inputs and only the last sees targets; a rank that
raised alone would leave the others waiting forever for activations that
never come.
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["raise_on_any_rank"]


def raise_on_any_rank(stage: _PipelineStageBase, error: str | None) -> None:
    """Raise ``ValueError`` on every rank of ``stage``'s group if any rank has an error."""
    flag = torch.tensor([error is not None], dtype=torch.int32, device=stage.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=stage.group)
    if flag.item() == 0:
        return
    errors: list = [None] * dist.get_world_size(stage.group)
    dist.all_gather_object(errors, error, group=stage.group)
    rank, message = next((r, e) for r, e in enumerate(errors) if e is not None)
    raise ValueError(f"ScheduleSeq1F1B.step: pipeline rank {rank}: {message}")

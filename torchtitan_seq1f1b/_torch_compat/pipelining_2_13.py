# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The private pipelining runtime of torch 2.13 and 2.14, as Seq1F1B's schedules use it.

Action IR, lowering passes, a stage's cached forward outputs and gradient
finalisation, as these versions define them. torch 2.14 only added pre-split
``arg_mbs``/``kwarg_mbs``/``target_mbs`` to ``step()``/``eval()``, which
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1B` takes on every version.
"""

from typing import Any

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["lower_forward_only", "set_finalize_gradients", "stage_outputs"]


def lower_forward_only(
    schedule: _PipelineScheduleRuntime, compute: dict[int, list[_Action]]
) -> dict[int, list[_Action]]:
    """torch's lowering (FSDP unshard/reshard, sends, receives) of a forward-only order.

    ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` insists on one
    backward per microbatch, so an eval order is lowered with its passes
    directly.
    """
    with_unshard = {rank: _add_unshard_reshard(actions) for rank, actions in compute.items()}
    return _add_send_recv(
        with_unshard, lambda s: schedule.stage_index_to_group_rank[s], schedule._num_stages
    )


def stage_outputs(stage: _PipelineStageBase, chunk_id: int) -> tuple[Any, ...]:
    """The outputs ``stage`` computed for ``chunk_id``, before they are sent."""
    outputs, _ = stage.fwd_cache[chunk_id]
    return outputs


def set_finalize_gradients(schedule: _PipelineScheduleRuntime, finalize: bool) -> None:
    """Whether this step reduces FSDP gradients at its end; always, before torch 2.15."""
    if not finalize:
        raise ValueError(
            "step(finalize_gradients=False) needs torch >= 2.15; this torch reduces "
            "FSDP gradients at the end of every step"
        )

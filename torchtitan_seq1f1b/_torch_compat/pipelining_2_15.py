# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The private pipelining runtime of torch 2.15, as Seq1F1B's schedules use it.

What changed from 2.13/2.14 for us:

- forward outputs live in ``_forward_chunk_states[i].live_outputs`` (no
  ``fwd_cache``) and are dropped once sent;
- every send needs an explicit ``WAIT_SEND_F``/``WAIT_SEND_B`` action, so a
  lowering built outside ``_prepare_schedule_with_comms`` adds them itself;
- ``_add_unshard_reshard`` takes the schedule's residency and lookahead;
- ``step(finalize_gradients=False)`` keeps FSDP gradients unreduced across
  calls.

Receive buffers are allocated lazily from ``tensor_meta``, which
:func:`~torchtitan_seq1f1b._torch_compat.stage_hooks.resize_recv_buffers`
resizes on every version.
"""

from typing import Any

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _add_wait_send,
    _PipelineScheduleRuntime,
    _resolve_unshard_lookahead,
    _validate_send_waits,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b._torch_compat.stage_metadata import (
    resize_recv_buffers,
    runtime_validation_disabled,
)

__all__ = [
    "PipelineRuntime",
    "lower_forward_only",
    "resize_recv_buffers",
    "runtime_validation_disabled",
    "set_finalize_gradients",
    "stage_outputs",
]

# Its signatures (``loss_kwargs`` included) are the ones Seq1F1B's schedules call.
PipelineRuntime = _PipelineScheduleRuntime


def lower_forward_only(
    schedule: _PipelineScheduleRuntime, compute: dict[int, list[_Action]]
) -> dict[int, list[_Action]]:
    """torch's lowering (FSDP unshard/reshard, sends, receives, send waits) of a forward-only order.

    ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` insists on one
    backward per microbatch (and adds gradient reductions), so an eval order
    is lowered with its passes directly, under the schedule's FSDP residency
    settings.
    """
    lookahead = _resolve_unshard_lookahead(
        schedule._unshard_lookahead,
        num_pp_ranks=len(compute),
        max_active_stages=schedule._max_active_stages,
    )
    with_unshard = {
        rank: _add_unshard_reshard(
            actions,
            max_active_stages=schedule._max_active_stages,
            unshard_lookahead=lookahead[rank],
        )
        for rank, actions in compute.items()
    }
    lowered = _add_wait_send(
        _add_send_recv(
            with_unshard,
            lambda s: schedule.stage_index_to_group_rank[s],
            schedule._num_stages,
        )
    )
    _validate_send_waits(lowered)
    return lowered


def stage_outputs(stage: _PipelineStageBase, chunk_id: int) -> tuple[Any, ...]:
    """The outputs ``stage`` computed for ``chunk_id``, before they are sent."""
    return tuple(stage._forward_chunk_states[chunk_id].live_outputs)


def set_finalize_gradients(schedule: _PipelineScheduleRuntime, finalize: bool) -> None:
    """Whether this step reduces FSDP gradients at its end (torch's ``finalize_gradients``)."""
    schedule._finalize_gradients = finalize

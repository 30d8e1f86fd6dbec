# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The private pipelining runtime of torch 2.11, as Seq1F1B's schedules use it.

What differs from 2.12 for us:

- receive infos hold a buffer allocated up front and no ``tensor_meta``; a
  model input is a ``_RootArgPlaceholder`` rather than a flagged receive
  info;
- every chunk's first-stage inputs and every output are checked against the
  shapes inferred from chunk 0, always (not only under DETAIL debugging);
- ``_initialize_stages`` takes no target, and opens each neighbour's channel
  with a send and a receive even where the neighbour stage is on the same
  rank (the V of zero-bubble V schedules), which gloo cannot run;
- as in 2.12, nothing in the runtime takes ``loss_kwargs`` (extra keyword
  arguments of the loss function, new in 2.13): :class:`PipelineRuntime`
  takes them in 2.13's signatures and refuses any that are given.

The action IR, the lowering passes, a stage's cached forward outputs
(``fwd_cache``) and gradient finalisation are the same from 2.11 to 2.14.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo

from torchtitan_seq1f1b.segmenting import scaled_seq_len

__all__ = [
    "PipelineRuntime",
    "lower_forward_only",
    "resize_recv_buffers",
    "runtime_validation_disabled",
    "set_finalize_gradients",
    "stage_outputs",
]


class PipelineRuntime(_PipelineScheduleRuntime):
    """torch's runtime with 2.13's ``loss_kwargs`` signatures, for a torch that lacks them."""

    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
        for stage in self._stages:
            stage._get_init_p2p_neighbors_ops = _neighbour_warmup_off_rank(stage)
        self._initialize_stages_of_torch(args, kwargs)

    def _initialize_stages_of_torch(self, *args) -> None:
        super()._initialize_stages(*args)

    def _compute_loss(self, output, target, loss_kwargs=None):
        return self._loss_fn(output, target)

    def _step_microbatches(
        self,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        losses=None,
        return_outputs=True,
        loss_kwargs: dict[str, Any] | None = None,
    ):
        if loss_kwargs:
            raise ValueError(
                "step(loss_kwargs=...) needs torch >= 2.13, whose pipeline runtime "
                "forwards them to the loss function; leave them out on this torch"
            )
        return super()._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs
        )


def _neighbour_warmup_off_rank(stage: _PipelineStageBase):
    """``stage``'s channel-opening sends and receives, less those to its own rank."""
    torch_ops = type(stage)._get_init_p2p_neighbors_ops

    def warmup_ops():
        return [op for op in torch_ops(stage) if op.group_peer != stage.group_rank]

    return warmup_ops


def _resize(infos, reference_infos, reference_tokens: int, seq_dim: int, seq_len: int) -> None:
    for info, reference in zip(infos, reference_infos):
        if not isinstance(info, _RecvInfo):
            continue
        buffer = info.buffer
        if buffer.dim() <= seq_dim:
            raise ValueError(
                f"Seq1F1B splits stage activations on dim {seq_dim}, but "
                f"'{info.input_name}' has shape {tuple(buffer.shape)}. "
                "Pass seq_dim matching the model's activations."
            )
        if not buffer.is_contiguous():
            raise ValueError(
                f"Seq1F1B needs contiguous stage activations; got stride {buffer.stride()} "
                f"for shape {tuple(buffer.shape)}. Make the stage output contiguous."
            )
        local_len = scaled_seq_len(reference.buffer.shape[seq_dim], reference_tokens, seq_len)
        if buffer.shape[seq_dim] == local_len:
            continue
        shape = list(buffer.shape)
        shape[seq_dim] = local_len
        info.buffer = torch.empty(
            shape, dtype=buffer.dtype, device=buffer.device
        ).requires_grad_(buffer.requires_grad)


def resize_recv_buffers(
    stage: _PipelineStageBase, chunk_seq_lens: Sequence[int], seq_dim: int
) -> None:
    """Give every chunk receive buffers sized for its segment (see
    :func:`~torchtitan_seq1f1b._torch_compat.stage_metadata.resize_recv_buffers`)."""
    for recv in (stage.args_recv_info, stage.grad_recv_info):
        if 0 not in recv:
            continue
        for chunk_id, seq_len in enumerate(chunk_seq_lens):
            if chunk_id in recv:
                _resize(recv[chunk_id], recv[0], chunk_seq_lens[0], seq_dim, seq_len)


@contextlib.contextmanager
def runtime_validation_disabled(stage: _PipelineStageBase) -> Iterator[None]:
    """Skip torch 2.11's per-chunk input and output shape checks.

    They compare every chunk against chunk 0's shapes, which uneven segments
    never match; Seq1F1B validates segment shapes itself.
    """
    stage._validate_fwd_input = lambda args, kwargs: None
    stage._validate_fwd_outputs = lambda outputs: None
    try:
        yield
    finally:
        del stage._validate_fwd_input, stage._validate_fwd_outputs


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

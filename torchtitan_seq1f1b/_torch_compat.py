# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every private ``torch.distributed.pipelining`` API this package touches.

Seq1F1B rides on torch's pipeline runtime (action IR, lowering passes, stage
send/recv machinery). Those pieces are private, so they are imported here and
nowhere else, and the torch versions they were tested against are pinned.
"""

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.distributed.pipelining.schedules import (  # noqa: F401
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
    get_schedule_class,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.pipelining._utils import _DTensorMeta, _TensorMeta

__all__ = [
    "TESTED_TORCH_RANGE",
    "check_torch_version",
    "resize_recv_buffers",
    "scaled_seq_len",
    "wrap_stage_compute",
]

# Inclusive lower bound, exclusive upper bound (major, minor).
TESTED_TORCH_RANGE = ((2, 13), (2, 14))
ALLOW_UNTESTED_ENV = "SEQ1F1B_ALLOW_UNTESTED_TORCH"


def check_torch_version(version: str = torch.__version__) -> None:
    """Fail early and clearly on a torch whose pipelining internals were not tested."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    low, high = TESTED_TORCH_RANGE
    if low <= (major, minor) < high or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"torchtitan_seq1f1b was tested with torch>={low[0]}.{low[1]},"
        f"<{high[0]}.{high[1]} and relies on private torch.distributed.pipelining "
        f"internals; found torch {version}. Install a tested torch "
        f"(pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}') or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


check_torch_version()


def scaled_seq_len(reference_len: int, reference_tokens: int, seq_len: int) -> int:
    """Local length of a ``seq_len``-token segment on a dim that held ``reference_len``
    entries for a ``reference_tokens``-token segment.

    Under sequence parallel a stage's activations carry ``tokens / tp`` entries
    on the sequence dim, as plain local tensors or as DTensor shards.
    """
    local, remainder = divmod(seq_len * reference_len, reference_tokens)
    if remainder:
        raise ValueError(
            f"a {seq_len}-token segment cannot be laid out like the first one "
            f"({reference_tokens} tokens held as {reference_len} entries, e.g. sharded "
            "by sequence parallel); make every segment length a multiple of the "
            "sequence-parallel degree (SegmentPlan align, [seq1f1b] align)"
        )
    return local


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _with_seq_len(
    meta: _TensorMeta, seq_dim: int, seq_len: int, local_len: int
) -> _TensorMeta:
    """The metadata of the same activation for a segment of ``seq_len`` tokens."""
    if tuple(meta.stride) != _contiguous_stride(meta.shape):
        raise ValueError(
            f"Seq1F1B needs contiguous stage activations; got stride {meta.stride} "
            f"for shape {tuple(meta.shape)}. Make the stage output contiguous."
        )
    shape = list(meta.shape)
    shape[seq_dim] = local_len
    changes = {"shape": torch.Size(shape), "stride": _contiguous_stride(shape)}
    if isinstance(meta, _DTensorMeta):
        global_shape = list(meta.global_shape)
        global_shape[seq_dim] = seq_len
        changes["global_shape"] = torch.Size(global_shape)
        changes["global_stride"] = _contiguous_stride(global_shape)
    return dataclasses.replace(meta, **changes)


def _resize(
    recv_infos, reference_infos, reference_tokens: int, seq_dim: int, seq_len: int, device
) -> None:
    for info, reference in zip(recv_infos, reference_infos):
        if info.is_root_arg or info.buffer is None:
            continue
        if info.buffer.dim() <= seq_dim:
            raise ValueError(
                f"Seq1F1B splits stage activations on dim {seq_dim}, but "
                f"'{info.input_name}' has shape {tuple(info.buffer.shape)}. "
                "Pass seq_dim matching the model's activations."
            )
        local_len = scaled_seq_len(
            reference.buffer.shape[seq_dim], reference_tokens, seq_len
        )
        if info.buffer.shape[seq_dim] == local_len:
            continue
        meta = _with_seq_len(info.tensor_meta, seq_dim, seq_len, local_len)
        info.tensor_meta = meta
        info.buffer = torch.empty_strided(
            meta.shape, meta.stride, dtype=meta.dtype, device=device
        )


def resize_recv_buffers(
    stage: _PipelineStageBase, chunk_seq_lens: Sequence[int], seq_dim: int
) -> None:
    """Give every chunk its own receive buffers sized for its segment.

    torch infers one activation shape per stage (from chunk 0) and allocates
    every chunk's buffers with it. Segments differ in length, and a short
    message into a long buffer is accepted silently by gloo (and hangs NCCL),
    so each chunk's activation and gradient buffers are resized here, keeping
    chunk 0's ratio of local entries to tokens (sequence parallel shards).
    """
    for recv in (stage.args_recv_info, stage.grad_recv_info):
        if 0 not in recv:
            continue
        for chunk_id, seq_len in enumerate(chunk_seq_lens):
            if chunk_id in recv:
                _resize(
                    recv[chunk_id], recv[0], chunk_seq_lens[0], seq_dim, seq_len, stage.device
                )


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


@contextlib.contextmanager
def runtime_validation_disabled(stage: _PipelineStageBase) -> Iterator[None]:
    """Turn off torch's per-chunk tensor validation (TORCH_DISTRIBUTED_DEBUG=DETAIL).

    It compares every chunk against the single shape inferred from chunk 0,
    which uneven segments never match; Seq1F1B validates segment shapes itself.
    """
    saved = stage._runtime_validate
    stage._runtime_validate = False
    try:
        yield
    finally:
        stage._runtime_validate = saved

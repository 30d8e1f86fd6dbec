# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Receive metadata and shape validation of torch 2.12-2.15's stages.

Per-chunk receive metadata (``args_recv_info`` / ``grad_recv_info`` and their
``tensor_meta``) and the DETAIL-mode validation flag have kept their names and
meaning from torch 2.12 to 2.15; torch 2.11's stages hold bare buffers
(:mod:`.pipelining_2_11`).
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.pipelining._utils import _DTensorMeta, _TensorMeta
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b.segmenting import scaled_seq_len

__all__ = ["resize_recv_buffers", "runtime_validation_disabled"]


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
        if info.is_root_arg or info.tensor_meta is None:
            continue
        shape = info.tensor_meta.shape
        if len(shape) <= seq_dim:
            raise ValueError(
                f"Seq1F1B splits stage activations on dim {seq_dim}, but "
                f"'{info.input_name}' has shape {tuple(shape)}. "
                "Pass seq_dim matching the model's activations."
            )
        local_len = scaled_seq_len(
            reference.tensor_meta.shape[seq_dim], reference_tokens, seq_len
        )
        if shape[seq_dim] == local_len:
            continue
        meta = _with_seq_len(info.tensor_meta, seq_dim, seq_len, local_len)
        info.tensor_meta = meta
        # torch 2.12-2.14 allocate some or all buffers up front; 2.15 allocates
        # from tensor_meta just before each receive and holds None until then.
        if info.buffer is not None:
            info.buffer = torch.empty_strided(
                meta.shape, meta.stride, dtype=meta.dtype, device=device
            )


def resize_recv_buffers(
    stage: _PipelineStageBase, chunk_seq_lens: Sequence[int], seq_dim: int
) -> None:
    """Give every chunk its own receive buffers sized for its segment.

    torch infers one activation shape per stage (from chunk 0) and sizes
    every chunk's receives with it. Segments differ in length, and a short
    message into a long buffer is accepted silently by gloo (and hangs NCCL),
    so each chunk's activation and gradient metadata (and buffer, where one is
    already allocated) is resized here, keeping
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

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
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed.pipelining.schedules as _schedules
from torch.distributed.pipelining.schedules import (  # noqa: F401
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
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
    "lower_forward_only",
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


def lower_forward_only(
    compute: dict[int, list[_Action]],
    stage_to_rank: Callable[[int], int],
    num_stages: int,
) -> dict[int, list[_Action]]:
    """torch's lowering (FSDP unshard/reshard, sends, receives) of a forward-only order.

    ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` insists on one
    backward per microbatch, so an eval order is lowered with its passes
    directly.
    """
    with_unshard = {rank: _add_unshard_reshard(actions) for rank, actions in compute.items()}
    return _add_send_recv(with_unshard, stage_to_rank, num_stages)


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


# ---- benchmark instrumentation ------------------------------------------------



@dataclasses.dataclass
class P2PWaitTime:
    """Wall time a rank spent blocked on pipeline sends and receives."""

    seconds: float = 0.0
    waits: int = 0


@contextlib.contextmanager
def timed_p2p_waits() -> Iterator[P2PWaitTime]:
    """Accumulate the time torch's pipeline schedules block on p2p work.

    Both schedule families wait only through ``schedules._wait_batch_p2p``:
    ``PipelineScheduleSingle`` subclasses (1F1B, GPipe) around every batched
    send/receive, and ``_PipelineScheduleRuntime`` (the looped, zero-bubble
    and Seq1F1B schedules) before a compute that needs a received tensor and
    on its outstanding sends at the end of a step. The function is looked up
    as a module global at call time, so replacing it covers both; the only
    other ``wait()`` in the runtime is on FSDP unshards, which are not p2p.
    """
    original = _schedules._wait_batch_p2p
    total = P2PWaitTime()

    def timed_wait(work):
        start = time.perf_counter()
        try:
            original(work)
        finally:
            total.seconds += time.perf_counter() - start
            total.waits += 1

    _schedules._wait_batch_p2p = timed_wait
    try:
        yield total
    finally:
        _schedules._wait_batch_p2p = original


# ---- torch's multi-stage schedule orders, for the simulator ---------------------


@dataclasses.dataclass(frozen=True)
class _ScheduleSizes:
    """The attributes torch 2.13's multi-stage order generators read from ``self``."""

    pp_group_size: int
    n_local_stages: int
    _n_microbatches: int

    @property
    def _stages(self) -> list[None]:  # ScheduleLoopedBFS counts its stages
        return [None] * self.n_local_stages

    @property
    def num_stages(self) -> int:  # ScheduleZBVZeroBubble
        return self.pp_group_size * self.n_local_stages

    @property
    def microbatches_per_round(self) -> int:  # ScheduleInterleaved1F1B
        return self._n_microbatches // max(1, self._n_microbatches // self.pp_group_size)


def torch_schedule_order(
    schedule_name: str, num_ranks: int, stages_per_rank: int, n_microbatches: int
) -> dict[int, list[_Action]]:
    """The compute actions torch's multi-stage schedule ``schedule_name`` runs, per rank.

    Calls the schedule class's ``_calculate_single_rank_operations`` (what its
    ``__init__`` calls for every rank) on a stand-in holding only the sizes it
    reads, so no stage, process group or model is needed. Idle slots are
    dropped. Checks of ``__init__`` (e.g. Interleaved1F1B's microbatch count)
    are not run.
    """
    schedule_class = get_schedule_class(schedule_name)
    sizes = _ScheduleSizes(num_ranks, stages_per_rank, n_microbatches)
    return {
        rank: [
            action
            for action in schedule_class._calculate_single_rank_operations(sizes, rank)
            if action is not None
        ]
        for rank in range(num_ranks)
    }

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Private pipelining hooks of the tools: p2p wait timing and torch's own orders.

The benchmark times how long torch's schedules block on sends and receives;
the simulator replays the orders torch's multi-stage schedules compute.
Both reach into torch 2.13/2.14 internals, so they live here; a training
process never imports this module.
"""

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as _schedules
from torch.distributed.pipelining.schedules import _Action, get_schedule_class

__all__ = ["P2PWaitTime", "recorded_p2p_receives", "timed_p2p_waits", "torch_schedule_order"]


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


@contextlib.contextmanager
def recorded_p2p_receives() -> Iterator[list[torch.Size]]:
    """The shape of every buffer torch's pipeline runtime posts a receive into.

    Every pipeline send and receive of torch 2.11-2.15 is issued through
    ``schedules._batch_p2p``, a module global looked up at call time; the
    receive buffer of each ``irecv`` in a batch is the tensor the peer's
    message lands in, whether the runtime allocated it up front (2.11-2.14) or
    just before the receive (2.15). The one-element receive by which torch
    2.11 opens each neighbour's channel is no activation and is left out.
    """
    original = _schedules._batch_p2p
    shapes: list[torch.Size] = []

    def recording_batch_p2p(p2p_ops, *args, **kwargs):
        shapes.extend(
            op.tensor.shape for op in p2p_ops if op.op is dist.irecv and op.tensor.dim() > 1
        )
        return original(p2p_ops, *args, **kwargs)

    _schedules._batch_p2p = recording_batch_p2p
    try:
        yield shapes
    finally:
        _schedules._batch_p2p = original


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

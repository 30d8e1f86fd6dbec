# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a torchtitan job config fixes for the planner, whichever torchtitan reads it."""

from dataclasses import dataclass

import torch

from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = ["JobLayout", "parallel_degrees"]


@dataclass(frozen=True)
class JobLayout:
    """A job config as its job would lay it out, resolved for the planner.

    Args:
        shape: the model's dims.
        seq_len: ``training.seq_len``.
        num_ranks: ``parallelism.pipeline_parallel_degree``.
        schedule: the Seq1F1B schedule the job runs (a key of ``SCHEDULES``).
        stages_per_rank: stages on every pipeline rank, as the job would split them.
        microbatches: ``training.local_batch_size`` over the microbatch size.
        microbatch_size: ``parallelism.pipeline_parallel_microbatch_size``.
        align: every segment length is a multiple of it, as the job cuts: ``seq1f1b.align``
            and the sequence shards of TP and CP (:func:`plan_align`).
        attention_backend: ``seq1f1b.attention_backend``.
        memory_budget_gib: ``seq1f1b.memory_budget_gib``.
        dtype: the dtype activations are computed in.
        context_parallel: ``parallelism.context_parallel_degree``.
    """

    shape: TransformerCost
    seq_len: int
    num_ranks: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    microbatch_size: int
    align: int
    attention_backend: str
    memory_budget_gib: float | None
    dtype: torch.dtype
    context_parallel: int


def parallel_degrees(parallelism) -> dict[str, int]:
    """``ParallelDims``' degrees from a job's ``parallelism`` section (the same fields in 0.2.2
    and 0.3). ``data_parallel_shard_degree = -1`` takes no ranks: no world size is known
    before the job launches."""
    return dict(
        dp_replicate=parallelism.data_parallel_replicate_degree,
        dp_shard=max(parallelism.data_parallel_shard_degree, 1),
        cp=parallelism.context_parallel_degree,
        tp=parallelism.tensor_parallel_degree,
        pp=parallelism.pipeline_parallel_degree,
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan's context parallelism handed to a Seq1F1B schedule (both releases).

torchtitan shards every microbatch over the CP ranks before the model sees
it (``prepare_context_parallel_input``, head-tail over the whole sequence),
and its attention exchanges K/V over the whole sequence. A Seq1F1B schedule
cuts each segment into head-tail pieces itself, so a Seq1F1B job:

- hands the schedule whole sequences (:func:`whole_sequences` around the
  trainer's ``post_dataloading_process``);
- gives the schedule the CP mesh as a :class:`ContextGroup` (:func:`context_group`);
- refuses the settings that would shard or balance otherwise
  (:func:`context_parallel_problems`).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from torchtitan_seq1f1b.context_parallel import ContextGroup, HeadTail

__all__ = ["context_group", "context_parallel_problems", "whole_sequences"]


def context_group(parallel_dims: Any) -> ContextGroup | None:
    """The job's CP mesh as a schedule's ``context_parallel``; None without CP."""
    if parallel_dims.cp <= 1:
        return None
    mesh = parallel_dims.get_mesh("cp")
    return ContextGroup(HeadTail(parallel_dims.cp, mesh.get_local_rank()), mesh.get_group())


@contextlib.contextmanager
def whole_sequences(parallel_dims: Any) -> Iterator[None]:
    """Within it, torchtitan's trainer sees no CP and leaves every sequence whole,
    for the schedule to cut by segment; its meshes are built already."""
    cp = parallel_dims.cp
    parallel_dims.cp = 1
    try:
        yield
    finally:
        parallel_dims.cp = cp


def context_parallel_problems(parallelism: Any) -> list[str]:
    """What a Seq1F1B job with ``parallelism.context_parallel_degree > 1`` cannot run,
    in the fields torchtitan 0.2.2 and 0.3 share."""
    degree, balancer = parallelism.context_parallel_degree, parallelism.context_parallel_load_balancer
    if degree <= 1 or balancer == "headtail":
        return []
    return [
        f"parallelism.context_parallel_load_balancer={balancer!r} with "
        f"context_parallel_degree={degree}: Seq1F1B balances CP itself, head-tail inside "
        "every segment (torchtitan's balancers cut the whole sequence); set "
        "--parallelism.context_parallel_load_balancer headtail"
    ]

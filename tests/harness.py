# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the multi-process exactness tests import: cases, the unsplit reference,
pipelined runs (:mod:`torchtitan_seq1f1b.exactness`), optionally through a GPU
kernel's CPU stand-in, and the gloo launcher."""

from dataclasses import dataclass

from torchtitan_seq1f1b import exactness
from torchtitan_seq1f1b._launch import RankFailure, run_ranks
from torchtitan_seq1f1b.exactness import reference, SCHEDULES

from tests.kernel_fakes import stand_in_backend

__all__ = ["Case", "RankFailure", "SCHEDULES", "pipelined", "pipelined_cases", "reference", "run_ranks"]


@dataclass(frozen=True)
class Case(exactness.Case):
    # "exact", or a GPU kernel's adapter run through its CPU stand-in
    # ("flash", "varlen", "cuda_exact"; see tests/kernel_fakes.py).
    kernel: str = "exact"


def pipelined(rank: int, world_size: int, case: Case, loss_normalizer: float | None = None) -> dict:
    """:func:`torchtitan_seq1f1b.exactness.pipelined`; through a stand-in
    kernel, the result also counts the attention calls that reached it
    (``kernel_calls``, training step and eval)."""
    if case.kernel == "exact":
        return exactness.pipelined(rank, world_size, case, loss_normalizer)
    backend, stand_in = stand_in_backend(case.kernel)
    result = exactness.pipelined(rank, world_size, case, loss_normalizer, backend)
    result["kernel_calls"] = len(stand_in.calls)
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]

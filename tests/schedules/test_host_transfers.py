# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Host reads and uploads of a packed-document step do not grow with the model or data.

On a GPU, reading a device value on the host and creating a tensor from
host data each stall the stream. A :class:`HostTransferCounter` on each
rank's training thread (and the fresh backward thread) counts them over a
second training step. With packed documents a step reads where documents
start once and uploads every segment's varlen layout once, so the counts
are the same with twice the layers, more rows per microbatch or many more
documents; through the exact path and through the varlen kernel's stand-in.
"""

import dataclasses

import pytest
import torch

from torchtitan_seq1f1b.check.counters import HostTransferCounter

from tests.harness import Case, runs_by_case, second_step_under
from tests.kernel_fakes import stand_in_backend

WORLD_SIZE = 2
BASE = Case(2, (12, 10, 8), n_kv_heads=2, n_layers=4, documents=((4, 13, 2, 11), (30,)))
VARIANTS = {
    "base": BASE,
    "deeper": dataclasses.replace(BASE, n_layers=8),
    "more rows": dataclasses.replace(BASE, microbatch_size=3),
    "more documents": dataclasses.replace(BASE, documents=((1,) * 30, (2, 3) * 6)),
}
CASES = [
    dataclasses.replace(case, kernel=kernel)
    for kernel in ("exact", "varlen")
    for case in VARIANTS.values()
]


def _second_step_transfers(rank: int, world_size: int, case: Case) -> tuple[int, int]:
    backend = None if case.kernel == "exact" else stand_in_backend(case.kernel)[0]
    counter = HostTransferCounter()
    second_step_under(rank, world_size, case, backend, counter)
    return counter.reads, counter.uploads


@pytest.fixture(scope="module")
def counts():
    return runs_by_case(_second_step_transfers, WORLD_SIZE, CASES)


@pytest.mark.parametrize("kernel", ["exact", "varlen"])
def test_a_step_reads_and_uploads_the_same_whatever_the_depth_rows_and_documents(counts, kernel):
    by_variant = {
        name: counts[dataclasses.replace(case, kernel=kernel)] for name, case in VARIANTS.items()
    }
    for name, per_rank in by_variant.items():
        assert per_rank == by_variant["base"], name
    # Reads: where documents start (nonzero, then tolist); the last stage also
    # counts the step's valid tokens. Upload: every segment's varlen layout in one tensor.
    assert by_variant["base"] == [(2, 1), (3, 1)]


def test_the_counter_sees_each_kind_of_transfer():
    ids = torch.arange(6).view(2, 3)
    with HostTransferCounter() as counter:
        ids.tolist()
        int(ids[0, 0])
        (ids > 2).nonzero()
        ids[ids > 2]
        torch.tensor([1, 2])
        with HostTransferCounter.ignored():
            ids.tolist()
            torch.tensor([3])
    assert (counter.reads, counter.uploads) == (4, 1)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Document ids, per-segment document layouts and what the K/V store keeps."""

import pytest
import torch

from torchtitan_seq1f1b.documents import (
    attention_pairs,
    check_document_ids,
    document_starts,
    MicrobatchDocuments,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan


def _ids(*rows: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(r) for _ in range(n)] for r in rows])


def test_document_starts_and_pairs_follow_the_definition():
    ids = _ids((3, 5, 4), (12,))
    starts = document_starts(ids)
    assert starts[0].tolist() == [0] * 3 + [3] * 5 + [8] * 4
    assert starts[1].tolist() == [0] * 12
    # by brute force: pairs (t, u) with u <= t in one document
    for start, end in ((0, 12), (5, 9), (8, 12)):
        brute = sum(
            int(row[u] == row[t]) for row in ids.tolist() for t in range(start, end) for u in range(t + 1)
        )
        assert attention_pairs(ids, start, end) == brute


def test_segment_layout_gives_each_document_its_queries_and_keys():
    plan = SegmentPlan.from_lengths((5, 3, 4))
    docs = MicrobatchDocuments(_ids((3, 5, 4), (1, 1, 10)), plan)
    middle = docs.segment(1)  # positions [5, 8)
    assert (middle.start, middle.end, middle.key_start) == (5, 8, 2)
    assert middle.row_key_start == (3, 2)
    # row 0: document [3, 8) has queries 5..7 and keys 3..7
    assert middle.bounds_q[0] == (0, 3) and middle.bounds_k[0] == (0, 5)
    cu_q, cu_k, max_q, max_k = middle.varlen_metadata(0, torch.device("cpu"))
    assert cu_q.dtype == cu_k.dtype == torch.int32 and (max_q, max_k) == (3, 5)
    assert middle.key_offset(0) == 1 and middle.key_offset(1) == 0
    last = docs.segment(2)  # [8, 12): row 0's third document starts at 8
    assert last.bounds_q[0] == (0, 4) and last.bounds_k[0] == (0, 4)
    mask = last.key_mask()
    assert mask.shape == (2, 1, 4, 12 - last.key_start)


def test_store_keeps_only_what_a_later_segment_reads_back():
    plan = SegmentPlan.from_lengths((5, 3, 4))
    # segment 1 starts inside [3, 8) -> reads back from 3; segment 2 starts a document
    assert MicrobatchDocuments(_ids((3, 5, 4)), plan).keep_from == 3
    # every document starts at a segment start: nothing is read back
    assert MicrobatchDocuments(_ids((5, 3, 4)), plan).keep_from == 12
    # one document over everything: causal attention, keep all
    assert MicrobatchDocuments(_ids((12,)), plan).keep_from == 0


@pytest.mark.parametrize(
    "ids, match",
    [
        ([[0, 0, 1, 1]], "tensor"),
        (torch.zeros(1, 4), "integer tensor"),
        (torch.zeros(2, 3, dtype=torch.long), "shape"),
        (torch.tensor([[0, 1, 1, 0]]), "decrease"),
    ],
)
def test_bad_ids_are_named(ids, match):
    assert match in check_document_ids(ids, 1 if not isinstance(ids, torch.Tensor) else ids.shape[0], 4)

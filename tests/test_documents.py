# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Document ids, per-segment document layouts and what the K/V store keeps."""

import pytest
import torch

from torchtitan_seq1f1b.attention.packing import _on_token_grid
from torchtitan_seq1f1b.check.counters import HostTransferCounter
from torchtitan_seq1f1b.documents import (
    attention_pairs,
    check_document_ids,
    document_starts,
    MicrobatchDocuments,
    read_document_starts,
    upload_varlen_layouts,
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
    spans = [(0, 12), (5, 9), (8, 12)]
    brute = [
        sum(int(row[u] == row[t]) for row in ids.tolist() for t in range(start, end) for u in range(t + 1))
        for start, end in spans
    ]
    assert attention_pairs(ids, spans) == brute


def test_segment_layout_gives_each_document_its_queries_and_keys():
    plan = SegmentPlan.from_lengths((5, 3, 4))
    docs = MicrobatchDocuments(_ids((3, 5, 4), (1, 1, 10)), plan)
    middle = docs.segment(1)  # positions [5, 8)
    assert (middle.start, middle.end, middle.key_start) == (5, 8, 2)
    assert middle.row_key_start == (3, 2)
    # row 0: document [3, 8) has queries 5..7 and keys 3..7
    assert middle.bounds_q[0] == (0, 3) and middle.bounds_k[0] == (0, 5)
    assert middle.key_offset(0) == 1 and middle.key_offset(1) == 0
    # Keys read in place from a 12-token buffer: row 0's key 2 and the buffer
    # between the rows' keys are sequences without queries.
    assert middle.packed_lengths(12) == ([0, 3, 0, 3], [1, 5, 6, 6])
    assert sum(middle.packed_lengths(12)[1]) == 12 + (8 - 2)
    assert not middle.dense
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
    ],
)
def test_bad_ids_are_named(ids, match):
    assert match in check_document_ids(ids, 1 if not isinstance(ids, torch.Tensor) else ids.shape[0], 4)


def test_document_starts_are_read_once_for_every_microbatch():
    first, second = _ids((3, 5, 4), (12,)), _ids((1, 11))
    assert read_document_starts([first, second]) == [[(0, 3, 8), (0,)], [(0, 1)]]
    assert "decrease" in read_document_starts([first, torch.tensor([[0, 1, 1, 0] * 3])])


def test_single_token_documents_merge_into_the_one_before_on_host_and_device():
    """One-token documents join the document before them (a row's first token stays a
    start): the host starts and the device ids agree, and nothing else changes."""
    plan = SegmentPlan.from_lengths((6, 6))
    documents = MicrobatchDocuments(_ids((1, 3, 1, 1, 5, 1), (2, 10), (12,)), plan)
    merged = documents.single_tokens_merged
    assert merged.row_starts == [(0, 1, 6), (0, 2), (0,)]
    assert MicrobatchDocuments(merged.ids, plan).row_starts == merged.row_starts
    assert merged.device_starts[0].tolist() == [0] + [1] * 5 + [6] * 6
    unchanged = MicrobatchDocuments(_ids((2, 10), (12,)), plan)
    assert unchanged.single_tokens_merged is unchanged


def test_one_upload_gives_every_mixed_segment_its_packed_layout():
    plan = SegmentPlan.from_lengths((5, 3, 4))
    microbatches = [MicrobatchDocuments(_ids((3, 5, 4), (1, 1, 10)), plan),
                    MicrobatchDocuments(_ids((12,), (12,)), plan)]
    upload_varlen_layouts(microbatches, torch.device("cpu"))
    mixed, single = microbatches
    assert single.segment(1).dense and single.segment(1).varlen is None
    layout = mixed.segment(1).varlen
    assert layout.cu_seqlens_q is not layout.cu_seqlens_k
    assert layout.cu_seqlens_q.dtype == torch.int32
    # keep_from is 2 (row 1's document at 2 is read back), so store rows hold 10 tokens
    assert layout.key_row_stride == 10 == mixed.key_row_stride(1)
    assert layout.cu_seqlens_q.tolist() == [0, 0, 3, 3, 6]
    assert layout.cu_seqlens_k.tolist() == [0, 1, 6, 10, 16]
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (3, 6)
    # both layouts come from one tensor: one host-to-device copy
    assert layout.cu_seqlens_q.untyped_storage().data_ptr() == (
        mixed.segment(2).varlen.cu_seqlens_k.untyped_storage().data_ptr()
    )


def test_sliding_window_layouts_go_up_in_the_same_copy_at_their_keys_stride():
    """A window of 4 earlier keys: each query's keys start at max(document start, t - 4);
    the op's keys (tail and own K/V, one contiguous tensor) find their layout uploaded."""
    plan = SegmentPlan.from_lengths((5, 3, 4))
    microbatch = MicrobatchDocuments(_ids((3, 5, 4), (12,)), plan)
    upload_varlen_layouts([microbatch], torch.device("cpu"), windows=[4])
    windowed = microbatch.segment(2, 4)
    # Row 0's last document starts with the segment; row 1's window reaches back 4 keys.
    assert (windowed.key_start, windowed.row_key_start) == (4, (8, 4))
    assert windowed.bounds_k == ((0, 4), (0, 8))
    visible = windowed.key_mask()[1, 0]  # row 1: one document, only the band
    assert visible.tolist() == [[k <= q + 4 and k >= q for k in range(8)] for q in range(4)]
    storage = microbatch.segment(1).varlen.cu_seqlens_q.untyped_storage().data_ptr()
    for j in (1, 2):
        layout = microbatch.segment(j, 4).varlen
        keys = microbatch.segment(j, 4).end - microbatch.segment(j, 4).key_start
        assert layout.key_row_stride == keys
        assert layout.cu_seqlens_q.untyped_storage().data_ptr() == storage
    q = torch.zeros(2, 4, 2, 8)
    k = torch.zeros(2, 8, 1, 8)
    with HostTransferCounter() as counter:
        assert _on_token_grid(q, k, k, windowed)[3] is windowed.varlen
    assert counter.uploads == 0

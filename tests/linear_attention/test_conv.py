# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The causal conv over a segment and its tail, within documents: finite differences
with a tail, qwen3_5's zero-padded conv1d on whole rows and on each document alone."""

import pytest
import torch

from torchtitan_seq1f1b.documents import document_starts
from torchtitan_seq1f1b.linear_attention.conv import document_causal_conv

from tests.linear_attention.gdn_runs import assert_close, document_ids, F64, report_worst, SEQ_LEN
from tests.linear_attention.reference import causal_conv_silu

FAMILY = "conv vs qwen3_5's conv1d"
WIDTH = 4


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    report_worst([FAMILY])


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]) - document_starts(ids)


def test_gradcheck_with_a_tail():
    """Tail, segment and weight gradients: 2 rows of 3 tokens after a 3-token tail,
    row 0 continuing a document begun 1 token into the tail, row 1 starting one at token 1."""
    generator = torch.Generator().manual_seed(0)
    tail, x = (torch.randn(2, n, 5, generator=generator, dtype=F64).requires_grad_() for n in (WIDTH - 1, 3))
    weight = torch.randn(5, 1, WIDTH, generator=generator, dtype=F64).requires_grad_()
    positions = torch.tensor([[2, 3, 4], [7, 0, 1]])

    def fn(tail, x, weight):
        return document_causal_conv(torch.cat((tail, x), 1), weight, positions)

    assert torch.autograd.gradcheck(fn, (tail, x, weight))


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_equals_zero_padded_conv1d_per_document(documents):
    """With a zero tail, the conv of each row equals qwen3_5's conv1d on each of its
    documents alone."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, SEQ_LEN, 5, generator=generator, dtype=F64)
    weight = torch.randn(5, 1, WIDTH, generator=generator, dtype=F64)
    ids = document_ids() if documents else torch.zeros(3, SEQ_LEN, dtype=torch.int64)
    window = torch.cat((x.new_zeros(3, WIDTH - 1, 5), x), 1)
    found = torch.nn.functional.silu(document_causal_conv(window, weight, _positions(ids)))
    expected = torch.cat([
        torch.cat([causal_conv_silu(x[[row]][:, ids[row] == doc], weight) for doc in ids[row].unique()], 1)
        for row in range(3)
    ])
    assert_close(found, expected, FAMILY, rtol=1e-14)

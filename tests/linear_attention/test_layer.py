# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The unsplit layer computes qwen3_5's GatedDeltaNet: on whole rows, and with packed
documents as if each document were a row of its own (output and every gradient)."""

import itertools

import pytest
import torch

from tests.linear_attention.gdn_runs import (
    assert_close,
    document_ids,
    DOCUMENTS,
    layer_inputs,
    make_layer,
    report_worst,
    SEQ_LEN,
    unsplit,
)
from tests.linear_attention.reference import qwen3_5_gdn

FAMILY = "unsplit layer vs qwen3_5's formulas"


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    report_worst([FAMILY])


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_unsplit_layer_is_qwen3_5_per_document(documents):
    layer = make_layer()
    x, grad_out = layer_inputs()
    ids = document_ids() if documents else None
    found = unsplit(layer, x, grad_out, ids)

    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    lengths = DOCUMENTS if documents else [(SEQ_LEN,)] * 3
    spans = [list(itertools.pairwise(itertools.accumulate(row, initial=0))) for row in lengths]
    out = torch.cat([
        torch.cat([qwen3_5_gdn(layer, leaf[row : row + 1, start:end]) for start, end in row_spans], 1)
        for row, row_spans in enumerate(spans)
    ])
    out.backward(grad_out)
    assert_close(found.out, out, FAMILY, "out", rtol=1e-12)
    assert_close(found.grad_x, leaf.grad, FAMILY, "grad of x", rtol=1e-12)
    for name, p in layer.named_parameters():
        assert_close(found.grads[name], p.grad, FAMILY, f"grad of {name}", rtol=1e-12)


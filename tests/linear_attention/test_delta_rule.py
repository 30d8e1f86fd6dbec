# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The plain-torch gated delta rule: its hand-written backward against finite
differences (initial state included), fla's naive recurrence per document, and a
sequence cut in two that hands its final state and that state's gradient across."""

import pytest
import torch

from torchtitan_seq1f1b.linear_attention import gated_delta_rule

from tests.linear_attention.gdn_runs import assert_close, F64, report_worst
from tests.linear_attention.reference import naive_delta_rule

FAMILIES = ["delta rule vs naive", "delta rule cut in two"]


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    report_worst(FAMILIES)


def _inputs(batch=2, length=6, heads=2, key_dim=3, value_dim=2, seed=0):
    """q, k, v, g (log decay <= 0), beta in (0, 1), initial state; float64 leaves."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    tensors = (
        draw(batch, length, heads, key_dim),
        draw(batch, length, heads, key_dim),
        draw(batch, length, heads, value_dim),
        -torch.rand(batch, length, heads, generator=generator, dtype=F64),
        torch.rand(batch, length, heads, generator=generator, dtype=F64),
        draw(batch, heads, key_dim, value_dim),
    )
    return [x.requires_grad_() for x in tensors]


def _resets(length=6) -> torch.Tensor:
    """Row 0 one document continuing the initial state; row 1 documents starting at 0, 2, 3."""
    resets = torch.zeros(2, length, dtype=torch.bool)
    resets[1, [0, 2, 3]] = True
    return resets


def test_gradcheck_with_initial_state_and_documents():
    """Every input's gradient, the initial state's included, through output and final state."""
    *inputs, initial = _inputs(length=5)
    resets = _resets(5)

    def fn(q, k, v, g, beta, initial):
        return gated_delta_rule(q, k, v, g, beta, 0.7, initial, resets)

    assert torch.autograd.gradcheck(fn, (*inputs, initial))


def test_matches_fla_naive_recurrence_per_document():
    """Output, final state and every gradient equal fla's naive recurrence run on each
    document alone (from the initial state for a row's continuing first document)."""
    q, k, v, g, beta, initial = _inputs()
    resets = _resets()
    grad_o = torch.randn(v.shape, dtype=F64)
    grad_final = torch.randn(initial.shape, dtype=F64)
    o, final = gated_delta_rule(q, k, v, g, beta, None, initial, resets)
    found = torch.autograd.grad((o, final), (q, k, v, g, beta, initial), (grad_o, grad_final))

    scale = q.shape[-1] ** -0.5
    documents = {0: [(0, 6)], 1: [(0, 2), (2, 3), (3, 6)]}  # as _resets lays them out
    outs, finals = [], []
    for row, spans in documents.items():
        pieces = []
        for start, end in spans:
            first = None if resets[row, start] else initial[row : row + 1]
            piece, final_state = naive_delta_rule(
                *(x[row : row + 1, start:end] for x in (q, k, v, g, beta)), scale, first
            )
            pieces.append(piece)
        outs.append(torch.cat(pieces, 1))
        finals.append(final_state)
    expected_o, expected_final = torch.cat(outs), torch.cat(finals)
    expected = torch.autograd.grad(
        (expected_o, expected_final), (q, k, v, g, beta, initial), (grad_o, grad_final)
    )
    family = FAMILIES[0]
    assert_close(o, expected_o, family, "o", rtol=1e-12)
    assert_close(final, expected_final, family, "final state", rtol=1e-12)
    for name, x, y in zip(("q", "k", "v", "g", "beta", "initial state"), found, expected):
        assert_close(x, y, family, f"grad of {name}", rtol=1e-12)


@pytest.mark.parametrize("cut", [2, 3, 4], ids=lambda c: f"cut{c}")
def test_a_cut_hands_on_the_state_and_its_gradient(cut):
    """Tokens [0, cut) then [cut, 6), the second starting from the first's final state,
    equal one call; cut 2 and 3 fall on row 1's document starts, 4 inside documents."""
    q, k, v, g, beta, initial = _inputs()
    resets = _resets()
    grad_o = torch.randn(v.shape, dtype=F64)
    whole, _ = gated_delta_rule(q, k, v, g, beta, None, initial, resets)
    expected = torch.autograd.grad(whole, (q, k, v, g, beta, initial), grad_o)

    first, state = gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), None, initial, resets[:, :cut])
    second, _ = gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), None, state, resets[:, cut:])
    found = torch.autograd.grad(torch.cat((first, second), 1), (q, k, v, g, beta, initial), grad_o)
    family = FAMILIES[1]
    assert_close(torch.cat((first, second), 1), whole, family, "o", rtol=1e-12)
    for x, y in zip(found, expected):
        assert_close(x, y, family, "grads", rtol=1e-12)

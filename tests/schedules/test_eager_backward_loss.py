# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A loss that backpropagates inside itself, as torchtitan's ``ChunkedLossWrapper``
does, under every Seq1F1B schedule, against unsplit training in float64.

The last stage outputs the final norm's hidden states; the loss applies a biased
output head chunk by chunk on detached copies, backpropagates each chunk at once
(the head's gradients accumulate during the forward), and returns a loss whose
backward hands the gathered hidden-state gradient to the stage. torch's metadata
inference runs that loss once on placeholder inputs before the first step; the
head's bias makes what that pass accumulates non-zero whatever the placeholders
hold, so a schedule that kept it fails here.
"""

import pytest
import torch
import torch.nn as nn

from torchtitan_seq1f1b.attention import bind_documents
from torchtitan_seq1f1b.check import exactness
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.examples.tiny_transformer import token_sum_cross_entropy

from tests.harness import Case, run_ranks, SCHEDULES

RTOL, ATOL = 1e-10, 1e-14


class _HiddenStateGrad(torch.autograd.Function):
    """loss (scalar) whose backward hands ``grad`` to ``hidden`` (batch, len, dim)."""

    @staticmethod
    def forward(ctx, hidden, grad, loss):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None, None


class EagerHeadLoss:
    """Mean token cross-entropy over ``valid_tokens``, through ``head``, in two
    chunks along the sequence; hidden: (batch, len, dim), target: (batch, len)."""

    def __init__(self, valid_tokens: int):
        self.valid_tokens = valid_tokens
        self.head: nn.Linear | None = None

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        chunks = [c.detach().requires_grad_(hidden.requires_grad) for c in hidden.chunk(2, 1)]
        total, grads = hidden.new_zeros(()), []
        for chunk, chunk_target in zip(chunks, target.chunk(2, 1)):
            loss = token_sum_cross_entropy(self.head(chunk), chunk_target) / self.valid_tokens
            total = total + loss.detach()
            if hidden.requires_grad:
                loss.backward()
                grads.append(chunk.grad)
        if not hidden.requires_grad:
            return total
        return _HiddenStateGrad.apply(hidden, torch.cat(grads, 1), total)


def _head(case: Case) -> nn.Linear:
    torch.manual_seed(2)
    args = case.model_args
    return nn.Linear(args.dim, args.vocab_size, bias=True, dtype=case.dtype)


def _valid_tokens(case: Case) -> int:
    return int((case.batch()[1] != -100).sum())


def _reference(case: Case) -> dict:
    model = case.model()
    model.output, model.head = None, _head(case)
    loss_fn = EagerHeadLoss(_valid_tokens(case))
    loss_fn.head = model.head
    tokens, target = case.batch()
    bind_documents(model, None)
    loss_fn(model(tokens), target).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _pipelined(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    results = []
    for case in cases:
        loss_fn = EagerHeadLoss(_valid_tokens(case))
        schedule, parts, indices = exactness.build_schedule(
            rank, world_size, case, loss_fn=loss_fn
        )
        # The output is the final norm's; the head is the last stage's, as in torchtitan.
        schedule.loss_normalizer = 1.0
        has_last = exactness.holds_last_stage(case, world_size, indices)
        if has_last:
            parts[-1].output, parts[-1].head = None, _head(case)
            loss_fn.head = parts[-1].head
        inputs, kwargs = exactness.step_inputs(rank, case, has_last)
        with backward_on_fresh_thread(case.device_thread):
            schedule.step(*inputs, **kwargs)
        results.append({n: p.grad for part in parts for n, p in part.named_parameters()})
    return results


CASES = [
    Case(
        2,
        (8, 4, 4),
        schedule=schedule,
        activation_checkpoint=ac,
        stages_per_rank=2 if schedule in ("InterleavedSeq1F1B", "Seq1F1BZBV") else 1,
    )
    for schedule, ac in [
        ("Seq1F1B", "none"),
        ("InterleavedSeq1F1B", "none"),
        ("Seq1F1BZeroBubble", "full"),
        ("Seq1F1BZBV", "none"),
    ]
]


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_pipelined, 2, CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.schedule for c in CASES])
def test_eager_backward_loss_matches_unsplit(runs, index):
    case = CASES[index]
    expected = _reference(case)
    got = {n: g for rank in runs for n, g in rank[index].items()}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=RTOL, atol=ATOL, msg=name)

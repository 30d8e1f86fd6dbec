# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A Seq1F1B stage sends contiguous activations and input gradients."""

import torch
import torch.nn as nn

from torchtitan_seq1f1b.integration.titan_0_3.contiguous import send_contiguous


class SequenceMajor(nn.Module):
    """(batch, seq, dim) -> the same values laid out sequence-major, as a
    reduce-scatter along the sequence leaves them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(0, 1).contiguous() * 2).transpose(0, 1)


def test_activation_and_input_gradient_are_contiguous():
    part = SequenceMajor()
    x = torch.randn(2, 5, 3, requires_grad=True)
    grad_out = torch.randn(5, 2, 3).transpose(0, 1)
    out = part(x)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    # Negative control: unhooked, neither is contiguous.
    assert not out.is_contiguous() and not grad.is_contiguous()
    send_contiguous(part)
    out = part(x)
    (grad_hooked,) = torch.autograd.grad(out, x, grad_out)
    assert out.is_contiguous() and grad_hooked.is_contiguous()
    assert torch.equal(out, 2 * x) and torch.equal(grad_hooked, grad)

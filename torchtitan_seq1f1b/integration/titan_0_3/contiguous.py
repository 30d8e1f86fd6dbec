# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline stages that send contiguous tensors, as Seq1F1B's receive buffers are.

Each segment's receive buffer is allocated contiguous for its length, and
torch 2.15 allocates the others with the sender's strides. Under sequence
parallelism a block's reduce-scatter along the sequence (forward) and the
all-gather's backward leave (batch, seq, dim) shards laid out sequence-major.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["send_contiguous"]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous local tensor (a DTensor's ``contiguous()`` looks at
    the global strides only); ``t`` itself where it already is."""
    if not isinstance(t, DTensor):
        return t.contiguous()
    local = t.to_local()
    if local.is_contiguous():
        return t
    return DTensor.from_local(
        local.contiguous(), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _contiguous(grad)


def _contiguous_input_grads(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args = tuple(
        _ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
        for a in args
    )
    return args, kwargs


def _contiguous_output(
    module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor
) -> torch.Tensor:
    return _contiguous(output)


def send_contiguous(part: nn.Module) -> None:
    """Make what ``part``'s stage sends contiguous: its activation and the
    gradient of its input (see the module docstring). Where they are
    contiguous already nothing is copied.
    """
    part.register_forward_pre_hook(_contiguous_input_grads, with_kwargs=True)
    part.register_forward_hook(_contiguous_output, with_kwargs=True)

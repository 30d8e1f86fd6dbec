# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Parameter gradients kept across torch's stage metadata inference.

Before a schedule's first step (and after a switch between eval and training),
torch's runtime runs every stage and, on the last, the loss on placeholder
inputs (uninitialised memory) to learn activation and gradient shapes. Its own
backward there computes input gradients only; a loss that backpropagates inside
itself, as torchtitan's ``ChunkedLossWrapper`` does through the output head,
accumulates that pass's gradients into the parameters, and the step's
gradients come out wrong by whatever the placeholder memory held.
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["parameter_grads_kept"]


@contextlib.contextmanager
def parameter_grads_kept(stages: Iterable[_PipelineStageBase]) -> Iterator[None]:
    """Within the block, gradients may accumulate; on leaving it every parameter
    of ``stages`` holds the gradient it held on entering (None included)."""
    params = [p for stage in stages for p in stage.submod.parameters()]
    saved = [None if p.grad is None else p.grad.clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, grad in zip(params, saved):
                if grad is None:
                    param.grad = None
                elif param.grad is None:
                    param.grad = grad
                else:
                    param.grad.copy_(grad)

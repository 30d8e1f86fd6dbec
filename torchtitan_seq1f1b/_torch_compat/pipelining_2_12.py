# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The private pipelining runtime of torch 2.12, as Seq1F1B's schedules use it.

2.11's runtime (no ``loss_kwargs``), with 2.13's stages: receive infos carry
``tensor_meta`` (:mod:`.stage_metadata`), shapes are validated only under
DETAIL debugging, and ``_initialize_stages`` takes the first target.
"""

from torchtitan_seq1f1b._torch_compat import pipelining_2_11
from torchtitan_seq1f1b._torch_compat.pipelining_2_11 import (
    lower_forward_only,
    set_finalize_gradients,
    stage_outputs,
)
from torchtitan_seq1f1b._torch_compat.stage_metadata import (
    resize_recv_buffers,
    runtime_validation_disabled,
)

__all__ = [
    "PipelineRuntime",
    "lower_forward_only",
    "resize_recv_buffers",
    "runtime_validation_disabled",
    "set_finalize_gradients",
    "stage_outputs",
]


class PipelineRuntime(pipelining_2_11.PipelineRuntime):
    """torch 2.12's runtime: 2.11's, whose stages also take the first target."""

    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
        self._initialize_stages_of_torch(args, kwargs, target)

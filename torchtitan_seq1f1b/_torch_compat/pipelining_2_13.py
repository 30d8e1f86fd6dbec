# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The private pipelining runtime of torch 2.13 and 2.14, as Seq1F1B's schedules use it.

2.12's, with the runtime's own signatures: ``_initialize_stages``,
``_compute_loss`` and ``_step_microbatches`` take ``loss_kwargs``. torch 2.14
only added pre-split ``arg_mbs``/``kwarg_mbs``/``target_mbs`` to
``step()``/``eval()``, which
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1B` takes on every version.
"""

from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

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

# Its signatures (``loss_kwargs`` included) are the ones Seq1F1B's schedules call.
PipelineRuntime = _PipelineScheduleRuntime

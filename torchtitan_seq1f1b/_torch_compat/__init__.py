# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every private torch API this package touches.

Seq1F1B rides on torch's pipeline runtime (action IR, lowering passes, stage
send/receive machinery). Those pieces are private, so they are imported here
and nowhere else, and the torch versions they were tested against are pinned:

- :mod:`.stage_hooks`: the stage's compute entry points, which every tested
  torch shares;
- one runtime module per torch whose private runtime differs
  (:mod:`.pipelining_2_11`, :mod:`.pipelining_2_12`, :mod:`.pipelining_2_13`
  for 2.13 and 2.14, :mod:`.pipelining_2_15`), whose runtime base class and
  functions are re-exported from here for the installed torch;
  :mod:`.stage_metadata` holds the receive metadata that 2.12-2.15 share;
- :mod:`.introspection`: hooks the benchmark and the simulator use to time
  torch's p2p waits and read torch's own schedule orders. Training never
  imports it;
- :mod:`.dispatch_modes`: torch's Python dispatch modes, for the counters
  and the CPU emulation of autograd's device threads;
- :mod:`.process_group_store`: the default process group's store, where
  ranks wait for the planner without a collective's timeout;
- :mod:`.devices`: the accelerator torch finds, as torchtitan asks for it;
- :mod:`.compile_counts`: how many graphs torch.compile has built;
- :mod:`.attention_ops`: the backward of torch's varlen attention, for the
  registered attention op.
"""

import os
from importlib import import_module

import torch

# Inclusive lower bound, exclusive upper bound (major, minor).
TESTED_TORCH_RANGE = ((2, 11), (2, 16))
ALLOW_UNTESTED_ENV = "SEQ1F1B_ALLOW_UNTESTED_TORCH"


def _release(version: str) -> tuple[int, int]:
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return major, minor


def check_torch_version(version: str = torch.__version__) -> None:
    """Fail early and clearly on a torch whose pipelining internals were not tested."""
    major, minor = _release(version)
    low, high = TESTED_TORCH_RANGE
    if low <= (major, minor) < high or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"torchtitan_seq1f1b was tested with torch>={low[0]}.{low[1]},"
        f"<{high[0]}.{high[1]} and relies on private torch.distributed.pipelining "
        f"internals; found torch {version}. Install a tested torch "
        f"(pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}') or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


check_torch_version()

# The action IR, the send/receive lowering, the runtime base class and its
# simulator mean the same in every tested torch.
from torch.distributed.pipelining._backward import (  # noqa: E402
    stage_backward_input,
    stage_backward_weight,
)
from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action,
    _add_send_recv,
    _ComputationType,
    _simulate_comms_compute,
)


TORCH_RELEASE = _release(torch.__version__)


def _runtime_module(release: tuple[int, int]) -> str:
    """The runtime module for ``release``; an untested newer torch (allowed by the
    environment variable) gets the newest, an older one the oldest."""
    for first, module in (((2, 15), "pipelining_2_15"), ((2, 13), "pipelining_2_13"),
                          ((2, 12), "pipelining_2_12")):
        if release >= first:
            return module
    return "pipelining_2_11"


_runtime = import_module(f"{__name__}.{_runtime_module(TORCH_RELEASE)}")
PipelineRuntime = _runtime.PipelineRuntime
lower_forward_only = _runtime.lower_forward_only
resize_recv_buffers = _runtime.resize_recv_buffers
runtime_validation_disabled = _runtime.runtime_validation_disabled
set_finalize_gradients = _runtime.set_finalize_gradients
stage_outputs = _runtime.stage_outputs

from torchtitan_seq1f1b._torch_compat.stage_hooks import wrap_stage_compute  # noqa: E402

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "PipelineRuntime",
    "TESTED_TORCH_RANGE",
    "TORCH_RELEASE",
    "_Action",
    "_add_send_recv",
    "_ComputationType",
    "_simulate_comms_compute",
    "check_torch_version",
    "lower_forward_only",
    "resize_recv_buffers",
    "runtime_validation_disabled",
    "set_finalize_gradients",
    "stage_backward_input",
    "stage_backward_weight",
    "stage_outputs",
    "wrap_stage_compute",
]

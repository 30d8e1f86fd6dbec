# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every private ``torch.distributed.pipelining`` API this package touches.

Seq1F1B rides on torch's pipeline runtime (action IR, lowering passes, stage
send/receive machinery). Those pieces are private, so they are imported here
and nowhere else, and the torch versions they were tested against are pinned:

- one runtime module per torch whose private runtime differs
  (:mod:`.pipelining_2_13` for 2.13 and 2.14), re-exported from here for the
  installed torch;
- :mod:`.introspection`: hooks the benchmark and the simulator use to time
  torch's p2p waits and read torch's own schedule orders. Training never
  imports it.
"""

import os

import torch

# Inclusive lower bound, exclusive upper bound (major, minor).
TESTED_TORCH_RANGE = ((2, 13), (2, 14))
ALLOW_UNTESTED_ENV = "SEQ1F1B_ALLOW_UNTESTED_TORCH"


def check_torch_version(version: str = torch.__version__) -> None:
    """Fail early and clearly on a torch whose pipelining internals were not tested."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
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

from torchtitan_seq1f1b._torch_compat.pipelining_2_13 import (  # noqa: E402
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
    lower_forward_only,
    resize_recv_buffers,
    runtime_validation_disabled,
    wrap_stage_compute,
)

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_TORCH_RANGE",
    "_Action",
    "_add_send_recv",
    "_ComputationType",
    "_PipelineScheduleRuntime",
    "_simulate_comms_compute",
    "check_torch_version",
    "lower_forward_only",
    "resize_recv_buffers",
    "runtime_validation_disabled",
    "wrap_stage_compute",
]

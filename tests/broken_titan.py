# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run a module with one part of Seq1F1B broken, as a negative control.

``python -m tests.broken_titan BREAK MODULE ARGS...`` (e.g. MODULE
torchtitan.train under torchrun), every backward on a fresh thread as in
:mod:`tests.device_thread`. BREAK is one of:

- "segment_attention": every segment attends to its own tokens only;
- "normalizer": gradients are divided by one token more than the step's count.
"""

import runpy
import sys

from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.schedule import ScheduleSeq1F1B

from tests.device_thread import install


def _break(what: str) -> None:
    if what == "segment_attention":
        KVStore.attach = lambda self, layer, k, v: (k, v)
    elif what == "normalizer":
        normalizer_for = ScheduleSeq1F1B._normalizer_for
        ScheduleSeq1F1B._normalizer_for = lambda self, target: normalizer_for(self, target) + 1
    else:
        raise SystemExit(f"unknown break {what!r}: use segment_attention or normalizer")


if __name__ == "__main__":
    install()
    _break(sys.argv[1])
    module = sys.argv[2]
    sys.argv = sys.argv[2:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

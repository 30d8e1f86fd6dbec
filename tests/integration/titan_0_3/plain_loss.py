# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's qwen3_5 debug configs with their cross entropy, not chunked.

Seq1F1B refuses torchtitan's ``ChunkedLossWrapper`` under the split-backward
schedules (Seq1F1BZeroBubble, Seq1F1BZBV); the jobs testing those train on
the wrapped loss itself.

``python -m tests.integration.titan_0_3.plain_loss MODULE ARGS...`` runs
MODULE as ``__main__`` with the configs of
:data:`~tests.integration.titan_0_3.smaller_vocab.CONFIGS` so changed.
"""

import runpy
import sys

from tests.integration.titan_0_3.smaller_vocab import change_qwen3_5_configs


def unchunked(job) -> None:
    job.loss = job.loss.loss_fn


if __name__ == "__main__":
    change_qwen3_5_configs(unchunked)
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

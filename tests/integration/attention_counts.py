# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Attention forward ops counted in each rank of a torchtitan job.

``python -m tests.integration.attention_counts MODULE ARGS...`` runs MODULE as
``__main__`` (under torchrun, the next launcher or torchtitan.train) with an
:class:`~torchtitan_seq1f1b.check.counters.AttentionForwardCounter` pushed on
the training thread, and writes the rank's count to ``$SEQ1F1B_ATTENTION_COUNTS/<RANK>``.

Over S steps of U units a rank runs S * U unit forwards, and one more on the
first step for torch's shape inference: ``L * (S * U + 1)`` attention ops for
L attention layers. R layers rerunning their attention in backward add
``R * S * U`` (``R * (S * U + 1)`` where the shape-inference forward's reruns too).
"""

import os
from pathlib import Path

from torchtitan_seq1f1b.check.counters import AttentionForwardCounter

from tests.launch import run_next_module

COUNTS_ENV = "SEQ1F1B_ATTENTION_COUNTS"


def counted_run(run, folder: Path, nproc: int, *args, **options) -> tuple[object, list[int]]:
    """``run(nproc, *args, **options)`` under the counter: (the run, each rank's count)."""
    job = run(
        nproc, *args,
        launchers=(__name__,), extra_env={COUNTS_ENV: str(folder)}, **options,
    )
    return job, [int((folder / str(rank)).read_text()) for rank in range(nproc)]


if __name__ == "__main__":
    counter = AttentionForwardCounter()
    try:
        with counter:
            run_next_module()
    finally:
        Path(os.environ[COUNTS_ENV], os.environ["RANK"]).write_text(str(counter.count))

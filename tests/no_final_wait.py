# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan's trainer without its final wait.

After the last step, rank 0 of a torchtitan job sleeps 2 s "for other ranks to
complete" (``Trainer.train``, 0.2.2 and 0.3): a quarter of a test job's time,
and nothing a test reads depends on it.
``python -m tests.no_final_wait MODULE ARGS...`` runs MODULE as ``__main__``
(under torchrun, the next launcher or torchtitan.train) with that one sleep
skipped; every other ``time.sleep`` sleeps. It imports only the standard
library, so the job imports torchtitan and this package as it would without it.
"""

import sys
import time
from pathlib import Path

from tests.launch import run_next_module

FINAL_WAIT_SECONDS = 2
_sleep = time.sleep


def _sleep_but_not_the_final_wait(seconds: float) -> None:
    caller = sys._getframe(1).f_code
    trainer = caller.co_name == "train" and Path(caller.co_filename).parent.name == "torchtitan"
    if not (trainer and seconds == FINAL_WAIT_SECONDS):
        _sleep(seconds)


if __name__ == "__main__":
    time.sleep = _sleep_but_not_the_final_wait
    run_next_module()

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a rank does in tests/check/test_job_server.py: ``python -m tests.check.job_ranks ACTION FOLDER``.

- ``facts``: writes ``FOLDER/<RANK>.json``, what the rank was started with;
- ``sleep``: writes ``FOLDER/<RANK>.pid`` and sleeps;
- ``fail-on-rank-0`` and ``exit-3-on-rank-0``: rank 0 raises ValueError (exits 3)
  once rank 1 has written its pid, the others sleep.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path


def facts() -> dict:
    return {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": {
            name: os.environ.get(name)
            for name in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "OMP_NUM_THREADS", "SEQ1F1B_JOB_FACT",
            )
        },
        "has_port": os.environ.get("MASTER_PORT", "").isdigit(),
        "loaded": {name: name in sys.modules for name in ("torch", "torchtitan", "torchtitan_seq1f1b")},
        "threads": threading.active_count(),
        "server": os.getppid(),
    }


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    rank = os.environ["RANK"]
    if action == "facts":
        (folder / f"{rank}.json").write_text(json.dumps(facts()))
    elif action == "sleep" or rank != "0":
        (folder / f"{rank}.pid").write_text(str(os.getpid()))
        time.sleep(600)
    else:
        while not (folder / "1.pid").exists():
            time.sleep(0.01)
        if action == "fail-on-rank-0":
            raise ValueError("rank 0 refuses")
        sys.exit(3)

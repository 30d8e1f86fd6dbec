# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run torchtitan jobs as torchrun subprocesses and read back their metrics.

For the tests and ``python -m torchtitan_seq1f1b.check``; the configs live in
the source checkout's ``train_configs/`` (not in an installed wheel).
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]  # the source checkout
DEBUG_CONFIG = REPO / "train_configs" / "debug_seq1f1b.toml"

# Small and short enough for CI; float32 because torchtitan's non-pipelined
# path autocasts to bf16 otherwise, which the PP path does not. Data and
# learning rate are pinned to what the tests' bf16 tolerance was measured on,
# whatever the debug job's demo uses.
TEST_ARGS = (
    "--training.seq_len", "128",
    "--training.dataset_path", "doc_tokens=257,words=256",
    "--optimizer.lr", "5e-3",
    "--training.local_batch_size", "4",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
    "--training.steps", "6",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard",
)


class RunFailed(RuntimeError):
    def __init__(self, returncode: int, output: str):
        super().__init__(f"torchrun exited with {returncode}:\n{output[-6000:]}")
        self.returncode = returncode
        self.output = output


@dataclass
class Run:
    dump_folder: Path
    output: str

    def scalars(self, tag: str) -> dict[int, float]:
        """{step: value} of a tensorboard scalar, from whichever rank logged it."""
        values: dict[int, float] = {}
        for events in sorted(self.dump_folder.rglob("events.out.tfevents.*")):
            accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
            accumulator.Reload()
            if tag in accumulator.Tags()["scalars"]:
                values.update({e.step: e.value for e in accumulator.Scalars(tag)})
        return values

    @property
    def losses(self) -> dict[int, float]:
        return self.scalars("loss_metrics/global_avg_loss")

    @property
    def grad_norms(self) -> dict[int, float]:
        return self.scalars("grad_norm")


def torchrun(
    dump_folder: Path,
    nproc: int,
    *args: str,
    config: Path = DEBUG_CONFIG,
    timeout: float = 400,
    extra_env: dict[str, str] | None = None,
    device_thread: bool = True,
) -> Run:
    """``torchrun -m torchtitan.train`` on the debug config plus ``args``, with
    ``extra_env`` added to the environment; raises :class:`RunFailed` with the
    output on a non-zero exit.

    ``device_thread``: every backward on a fresh thread
    (:mod:`torchtitan_seq1f1b.check.device_thread`), as CUDA's autograd runs it.
    """
    train = ["torchtitan_seq1f1b.check.device_thread"] * device_thread + ["torchtitan.train"]
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
        "-m", *train,
        "--job.config_file", str(config),
        "--job.dump_folder", str(dump_folder),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOG_RANK=",".join(map(str, range(nproc))))
    env.update(extra_env or {})
    result = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RunFailed(result.returncode, result.stdout)
    return Run(Path(dump_folder), result.stdout)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run torchtitan jobs under torchrun (or forked from a :class:`JobServer`) and read back their metrics.

For the tests and ``python -m torchtitan_seq1f1b.check``, on whichever
torchtitan release is installed: 0.2.2 runs the source checkout's
``train_configs/`` TOML (not in an installed wheel), 0.3 the package's config
registry (``--module torchtitan_seq1f1b --config seq1f1b_debug``).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_seq1f1b.check.job_server import JobServer
from torchtitan_seq1f1b.integration import MAIN, titan_release

__all__ = [
    "DEBUG_CONFIG",
    "DEBUG_CONFIG_0_3",
    "REPO",
    "Run",
    "RunFailed",
    "TEST_ARGS",
    "TEST_ARGS_0_2",
    "TEST_ARGS_0_3",
    "TEST_ARGS_MAIN",
    "job_args",
    "torchrun",
    "unpipelined_args",
]

REPO = Path(__file__).resolve().parents[2]  # the source checkout
DEBUG_CONFIG = REPO / "train_configs" / "debug_seq1f1b.toml"
# torchtitan 0.3: "<module>:<config function>" of the debug job.
DEBUG_CONFIG_0_3 = "torchtitan_seq1f1b:seq1f1b_debug"


# Small and short enough for CI; float32 because torchtitan's non-pipelined
# path autocasts to bf16 otherwise, which the PP path does not. Data and
# learning rate are pinned, whatever the debug job's demo uses: the tests'
# bf16 tolerance is set for these.
TEST_ARGS_0_2 = (
    "--training.seq_len", "128",
    "--training.dataset_path", "doc_tokens=257,words=256",
    "--optimizer.lr", "5e-3",
    "--training.local_batch_size", "4",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
    "--training.steps", "3",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard",
)
# torchtitan 0.3 masks documents always: 41-token documents in 128-token
# windows cross segment and window borders, and every row of a microbatch
# has its own layout. The debug config's learning rate and float32.
TEST_ARGS_0_3 = (
    "--training.seq_len", "128",
    "--dataloader.dataset_path", "doc_tokens=41,words=64",
    "--training.local_batch_size", "4",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
    "--training.steps", "3",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
)
# torchtitan main: its packed rows of two 128-token documents (its dataset is no flag).
TEST_ARGS_MAIN = (
    "--training.steps", "3",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
)
TEST_ARGS = {"0.3": TEST_ARGS_0_3, MAIN: TEST_ARGS_MAIN}.get(titan_release(), TEST_ARGS_0_2)


def unpipelined_args(dp: int = 1, config: str = "seq1f1b_debug") -> tuple[str, ...]:
    """The flags that make a job of ``config`` (a ``--module torchtitan_seq1f1b`` config
    name, at ``dp`` data-parallel ranks) its non-pipelined reference: PP 1 and, on main,
    where a step without PP is one microbatch, the pipelined step's tokens by gradient
    accumulation."""
    if titan_release() != MAIN:
        return ("--parallelism.pipeline_parallel_degree", "1")
    from torchtitan_seq1f1b.integration.titan_0_3 import config_registry

    job = getattr(config_registry, config)()
    step_tokens = (
        job.training.num_tokens_per_microbatch_per_dp_rank * job.parallelism.num_pp_microbatches
    )
    return (
        "--parallelism.pipeline_parallel_degree", "1",
        "--training.num_tokens_per_train_step", str(step_tokens * dp),
    )


def job_args(dump_folder: Path, config: Path | str | None = None) -> tuple[str, ...]:
    """The arguments that select a job config and its dump folder on the installed
    torchtitan: a TOML path (0.2.2) or "<module>:<config function>" (0.3)."""
    if titan_release() in ("0.3", MAIN):
        module, function = str(config or DEBUG_CONFIG_0_3).split(":")
        return ("--module", module, "--config", function, "--dump_folder", str(dump_folder))
    return ("--job.config_file", str(config or DEBUG_CONFIG), "--job.dump_folder", str(dump_folder))


class RunFailed(RuntimeError):
    def __init__(self, returncode: int, output: str):
        super().__init__(f"the job exited with {returncode}:\n{output[-6000:]}")
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
    config: Path | str | None = None,
    timeout: float = 400,
    extra_env: dict[str, str] | None = None,
    device_thread: bool = True,
    launchers: tuple[str, ...] = (),
    server: JobServer | None = None,
) -> Run:
    """``torchrun -m torchtitan.train`` on the debug config (or ``config``, see
    :func:`job_args`) plus ``args``, with
    ``extra_env`` added to the environment; raises :class:`RunFailed` with the
    output on a non-zero exit.

    ``device_thread``: every backward on a fresh thread
    (:mod:`torchtitan_seq1f1b.check.device_thread`), as CUDA's autograd runs it.
    ``launchers``: modules run outermost first, each running the next
    (``python -m LAUNCHER MODULE ARGS...``). A job a rank aborts only after
    its process groups are destroyed runs once more (:func:`_aborted_in_teardown`).
    ``server``: the ranks fork from it (CPU jobs only) instead of starting under torchrun.
    """
    train = [
        *launchers,
        *["torchtitan_seq1f1b.check.device_thread"] * device_thread,
        "torchtitan.train",
    ]
    train_args = [*job_args(dump_folder, config), *args]
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
        "-m", *train, *train_args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOG_RANK=",".join(map(str, range(nproc))))
    env.update(extra_env or {})

    def launch() -> subprocess.CompletedProcess:
        if server is not None:
            return server.run(train, train_args, nproc, env, REPO, timeout)
        return subprocess.run(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )

    restore = _restorer(Path(dump_folder))
    result = launch()
    if result.returncode != 0 and _aborted_in_teardown(result.stdout):
        restore()
        result = launch()
    if result.returncode != 0:
        raise RunFailed(result.returncode, result.stdout)
    return Run(Path(dump_folder), result.stdout)


def _restorer(folder: Path) -> Callable[[], None]:
    """A function that puts ``folder`` (a job's dump folder) back as it is now."""
    saved = None
    if folder.is_dir() and any(folder.iterdir()):
        saved = Path(tempfile.mkdtemp()) / folder.name
        shutil.copytree(folder, saved)

    def restore() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        if saved is None:
            folder.mkdir(parents=True)
        else:
            shutil.copytree(saved, folder)

    return restore


def _aborted_in_teardown(output: str) -> bool:
    """A rank aborted after the job destroyed its process groups: gloo on CPU now and
    then terminates a joinable thread at exit. The job itself ran; it is run again."""
    return (
        "terminate called without an active exception" in output
        and "Process group destroyed" in output
    )

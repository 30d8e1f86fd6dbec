# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run a function on several local ranks: gloo on CPU (tests, benchmarks), or NCCL with one GPU per rank (``python -m torchtitan_seq1f1b.check``)."""

import multiprocessing
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "run_ranks"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(worker, rank, world_size, port, results, backend, group_timeout, environ, cwd, args):
    # A fork of the server has the server's environment and directory: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # One intra-op thread per rank: ranks share the machine's cores.
    torch.set_num_threads(1)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    # Under torchrun, rank 0 would join the agent's store instead of serving its own.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=None if group_timeout is None else timedelta(seconds=group_timeout),
        )
        # Plain pickle: tensors travel by value, not through shared memory
        # that dies with this process.
        results.put((rank, "ok", pickle.dumps(worker(rank, world_size, *args))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(module: str, backend: str) -> multiprocessing.context.BaseContext:
    """Where ranks start: GPU ranks spawn fresh (CUDA cannot run in a fork of a process
    that initialised it); CPU ranks fork from a server that imported ``module`` once,
    at the first launch (later preload lists do not restart it)."""
    if backend == "nccl":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([module])
    return ctx


class RankFailure(RuntimeError):
    """Raised in the parent with every failing rank's error."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"[rank {r}] {e}" for r, e in sorted(errors.items())))


def run_ranks(
    worker: Callable,
    world_size: int,
    *args,
    timeout: float = 300,
    backend: str = "gloo",
    group_timeout: float | None = None,
) -> list:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` local ranks.

    ``backend`` is "gloo" or "nccl" (rank r then runs on GPU r);
    ``group_timeout`` the process group's collective timeout in seconds
    (torch's default if None).
    ``worker`` must be importable. Gloo ranks fork from a server that imported the
    first worker's module (and torch) once, instead of each importing torch anew;
    either way a rank runs in the caller's environment and directory. Returns
    each rank's result; raises RankFailure if any rank raised and
    TimeoutError (after killing every rank) if they do not all finish.
    """
    ctx = _context(worker.__module__, backend)
    results = ctx.Queue()
    port = _free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_entry,
            args=(worker, rank, world_size, port, results, backend, group_timeout, environ, cwd, args),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, object]] = {}
    try:
        while len(outcomes) < world_size:
            rank, status, value = results.get(timeout=timeout)
            outcomes[rank] = (status, value)
    except queue.Empty:
        raise TimeoutError(
            f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish "
            f"in {timeout}s (hang); finished: {outcomes}"
        ) from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RankFailure(errors)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]

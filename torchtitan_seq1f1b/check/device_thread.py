# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Run every autograd backward on a fresh thread, as CUDA runs it.

On CUDA, torch's autograd engine executes backward on a per-device worker
thread: custom Function backwards and activation-checkpoint recompute run
there, and see none of the calling thread's context variables or
thread-locals. On CPU the engine runs on the calling thread, so a CPU test
would pass where a GPU run fails. Routing ``torch.autograd.backward`` and
``torch.autograd.grad`` (which ``Tensor.backward`` and torch's pipeline
stages call) through a new thread that the caller joins reproduces what CUDA
does, including the caller blocking while backward runs. Like autograd's
device threads, the fresh thread inherits the caller's dispatch modes. The
tests and ``python -m torchtitan_seq1f1b.check --device cpu`` use it.
"""

import contextlib
import functools
import runpy
import threading
from collections.abc import Callable, Iterator

import torch

from torchtitan_seq1f1b._torch_compat.dispatch_modes import current_dispatch_modes

__all__ = ["backward_on_fresh_thread", "install"]


def _on_fresh_thread(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        outcome: dict = {}
        modes = current_dispatch_modes()

        def target():
            try:
                with contextlib.ExitStack() as inherited:
                    for mode in modes:
                        inherited.enter_context(mode)
                    outcome["value"] = fn(*args, **kwargs)
            except BaseException as error:  # re-raised on the calling thread
                outcome["error"] = error

        thread = threading.Thread(target=target, name="autograd-device-thread")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    run.runs_on_fresh_thread = True
    return run


def install() -> None:
    """Route every backward of this process through a fresh thread, for good."""
    if not getattr(torch.autograd.backward, "runs_on_fresh_thread", False):
        torch.autograd.backward = _on_fresh_thread(torch.autograd.backward)
        torch.autograd.grad = _on_fresh_thread(torch.autograd.grad)


@contextlib.contextmanager
def backward_on_fresh_thread(enabled: bool = True) -> Iterator[None]:
    """Within the block, every backward runs on a fresh thread (see module doc)."""
    saved = torch.autograd.backward, torch.autograd.grad
    if enabled:
        install()
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = saved


if __name__ == "__main__":
    # ``python -m torchtitan_seq1f1b.check.device_thread MODULE ARGS...``: run MODULE as __main__
    # (e.g. torchtitan.train under torchrun) with every backward on a fresh thread.
    import sys

    install()
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    # Launching through this module imported the package before torchtitan, so
    # its __init__ did not hook into torchtitan; forgetting the package (not its
    # submodules) lets the job's custom_import run __init__ again, inside the
    # trainer, as it would without this launcher.
    del sys.modules["torchtitan_seq1f1b"]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

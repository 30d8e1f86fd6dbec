# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What every test launcher ends with: ``python -m tests.<launcher> MODULE ARGS...``
runs MODULE as ``__main__`` with ARGS (under torchrun, the next launcher or
torchtitan.train), once the launcher has changed what it changes."""

import runpy
import sys

__all__ = ["run_next_module"]


def run_next_module() -> None:
    """Run ``sys.argv[1]`` as ``__main__``, with the arguments after it as its argv."""
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

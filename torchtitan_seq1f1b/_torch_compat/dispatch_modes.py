# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch's Python dispatch modes: the base class counters extend, and the calling
thread's mode stack, which autograd's device threads inherit."""

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, TorchDispatchMode

__all__ = ["TorchDispatchMode", "current_dispatch_modes"]


def current_dispatch_modes() -> list[TorchDispatchMode]:
    """The calling thread's dispatch modes, outermost first."""
    return _get_current_dispatch_mode_stack()

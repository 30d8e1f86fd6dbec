# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Counting what a step dispatches, for tests and the GPU check.

A :class:`AttentionForwardCounter` pushed on the training thread sees every
attention forward op that runs, in forward and in checkpointing's recompute
(autograd's device threads inherit the mode, as
:mod:`~torchtitan_seq1f1b.check.device_thread` does on CPU). Selective
checkpointing answers the ops it saved from its cache without dispatching
them, so they are not counted twice.
"""

from torchtitan_seq1f1b._torch_compat.dispatch_modes import TorchDispatchMode
from torchtitan_seq1f1b.attention import attention_forward_ops

__all__ = ["AttentionForwardCounter"]


class AttentionForwardCounter(TorchDispatchMode):
    """Counts attention forward ops (:func:`attention_forward_ops`) in ``count``."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._ops = attention_forward_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self._ops:
            self.count += 1
        return func(*args, **(kwargs or {}))

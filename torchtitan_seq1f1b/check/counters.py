# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Counting what a step dispatches, for tests and the GPU check.

A :class:`AttentionForwardCounter` pushed on the training thread sees every
attention forward op that runs, in forward and in checkpointing's recompute
(autograd's device threads inherit the mode, as
:mod:`~torchtitan_seq1f1b.check.device_thread` does on CPU). Selective
checkpointing answers the ops it saved from its cache without dispatching
them, so they are not counted twice.

A :class:`HostTransferCounter` counts what would stall a GPU's host: device
values read back, and tensors made from host data (each an upload). On CPU
they cost nothing, so a count that grows with depth, rows or documents is
how a per-layer or per-row sync shows before a GPU sees it.
"""

import contextlib
import threading
from collections.abc import Iterator

import torch

from torchtitan_seq1f1b._torch_compat.dispatch_modes import TorchDispatchMode
from torchtitan_seq1f1b.attention import attention_forward_ops

__all__ = ["AttentionForwardCounter", "HostTransferCounter"]


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


_READS = {
    torch.ops.aten._local_scalar_dense.default,  # item(), int(), bool()
    torch.ops.aten.nonzero.default,  # its output size is read back
}
_UPLOADS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class HostTransferCounter(TorchDispatchMode):
    """Counts host reads of device values (``reads``) and tensors created from
    host data (``uploads``) while active, on every thread that inherits it.

    Reads are ``item``/``int``/``bool`` of a tensor, ``nonzero``, boolean-mask
    indexing and ``Tensor.tolist`` (invisible to dispatch, so wrapped while
    active). Code standing in for a device kernel checks its inputs inside
    :meth:`ignored`: a real kernel reads them on the device.
    """

    _ignoring = threading.local()

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.uploads = 0
        self._tolist = None

    @classmethod
    @contextlib.contextmanager
    def ignored(cls) -> Iterator[None]:
        depth = getattr(cls._ignoring, "depth", 0)
        cls._ignoring.depth = depth + 1
        try:
            yield
        finally:
            cls._ignoring.depth = depth

    def _counting(self) -> bool:
        return not getattr(self._ignoring, "depth", 0)

    def __enter__(self):
        tolist, counter = torch.Tensor.tolist, self

        def counted_tolist(tensor):
            if counter._counting():
                counter.reads += 1
            return tolist(tensor)

        self._tolist, torch.Tensor.tolist = tolist, counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._counting():
            if func in _READS or (func is torch.ops.aten.index.Tensor and _bool_index(args)):
                self.reads += 1
            elif func in _UPLOADS:
                self.uploads += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
    )

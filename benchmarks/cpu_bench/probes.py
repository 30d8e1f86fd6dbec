# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Peak activation memory measured inside real pipeline steps, for the benchmark.

:class:`ActivationMemoryProbe` counts the bytes a rank holds for backward
from the tensors autograd actually saves (plus K/V stores). It does not
change what the schedules compute and undoes itself on exit. When each
compute call runs is recorded by
:class:`~benchmarks.planner_probes.compute_spans.ComputeRecorder`.
"""

import contextlib
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from torchtitan_seq1f1b.kv_store import KVStore

__all__ = ["ActivationMemoryProbe"]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Saved:
    """What autograd keeps instead of a saved tensor while the probe is on.

    Autograd drops it when it releases the saved tensor (when a backward
    without ``retain_graph`` runs that node, or when the graph is freed: for
    split backwards, nodes the weight-gradient step does not visit keep their
    tensors until then), which is when the probe stops counting the storage.
    """

    __slots__ = ("tensor", "_probe", "_key")

    def __init__(self, tensor: torch.Tensor, probe: "ActivationMemoryProbe", key):
        self.tensor, self._probe, self._key = tensor, probe, key

    def __del__(self):
        self._probe._release(self._key)


class ActivationMemoryProbe:
    """Measured peak of activation bytes on one rank over the steps it is active.

    Activations are the distinct storages autograd saved for backward and has
    not released yet (seen through ``saved_tensors_hooks``), except the
    parameters of ``modules``. K/V stores are counted as ``KVStore.nbytes``
    (their K/V buffers and banked prefix gradients); the views of K/V buffers
    that attention saves are left out of the saved storages so they are not
    counted twice. The peak is the largest sum seen at any save or release.

    Stage outputs kept by torch only for sending (not saved by autograd),
    receive buffers not yet consumed, and temporaries inside one op are not
    activations here.

    Args:
        modules: the rank's stage modules; their parameters are excluded.
        kv_stores: the rank's K/V stores (``ScheduleSeq1F1B.kv_stores``).
    """

    def __init__(self, modules: Iterable[nn.Module], kv_stores: Sequence[KVStore] = ()):
        self._parameter_keys = {
            _storage_key(p) for module in modules for p in module.parameters()
        }
        self._kv_stores = list(kv_stores)
        self._kv_keys: set[tuple[int, int]] = set()
        self._references: dict[tuple[int, int], int] = {}
        self._saved_bytes = 0
        self.peak_bytes = 0
        self.peak_saved_bytes = 0
        self.peak_kv_bytes = 0
        self._exit_stack = contextlib.ExitStack()

    def __enter__(self) -> "ActivationMemoryProbe":
        for store in self._kv_stores:
            self._exit_stack.enter_context(self._watch_kv_buffers(store))
        self._exit_stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        )
        return self

    def __exit__(self, *exc_info) -> None:
        self._exit_stack.close()

    @contextlib.contextmanager
    def _watch_kv_buffers(self, store: KVStore):
        """Learn which storages belong to ``store`` from the views ``attach`` returns."""
        attach = store.attach

        def watched_attach(*args, **kwargs):
            views = attach(*args, **kwargs)
            for view in views:
                key = _storage_key(view)
                if key not in self._kv_keys:
                    self._kv_keys.add(key)
                    # The address may be reused once the buffer is freed.
                    weakref.finalize(view.untyped_storage(), self._kv_keys.discard, key)
            return views

        store.attach = watched_attach
        try:
            yield
        finally:
            del store.attach  # back to the class's method

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key[1] == 0 or key in self._parameter_keys or key in self._kv_keys:
            return tensor
        count = self._references.get(key, 0)
        self._references[key] = count + 1
        if count == 0:
            self._saved_bytes += key[1]
            self._record_peak()
        # A detached alias: keeping the tensor itself would, for a saved
        # output, form a cycle through its grad_fn that keeps the graph (and
        # every tensor it saved) alive after autograd is done with it.
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: tuple[int, int]) -> None:
        count = self._references.pop(key) - 1
        if count:
            self._references[key] = count
            return
        # K/V gradient buffers grow during backward, before saved tensors go.
        self._record_peak()
        self._saved_bytes -= key[1]

    def _record_peak(self) -> None:
        kv_bytes = sum(store.nbytes for store in self._kv_stores)
        self.peak_saved_bytes = max(self.peak_saved_bytes, self._saved_bytes)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        self.peak_bytes = max(self.peak_bytes, self._saved_bytes + kv_bytes)

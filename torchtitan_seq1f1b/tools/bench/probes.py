# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Measurements taken inside real pipeline steps, for the benchmark.

- :class:`ActivationMemoryProbe`: peak bytes a rank holds for backward,
  counted from the tensors autograd actually saves (plus K/V stores).
- :class:`ComputeRecorder`: start/end time of every forward/backward a
  stage runs, for real-run timelines.

Neither changes what the schedules compute; both undo themselves on exit.
"""

import contextlib
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b.kv_store import KVStore

__all__ = ["ActivationMemoryProbe", "ComputeRecorder", "ComputeSpan"]


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


@dataclass(frozen=True)
class ComputeSpan:
    """One compute call of a stage: kind "F", "B" (full backward), "I" or "W"."""

    stage: int
    kind: str
    chunk: int
    start: float
    end: float


class ComputeRecorder:
    """Record when each of ``stages`` runs forward/backward compute (``time.perf_counter``).

    Wraps the stages' ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk``, where every torch schedule's compute ends,
    on top of any wrapper already there (Seq1F1B's unit scope), and restores
    them on exit. ``chunk`` is torch's microbatch index (a Seq1F1B unit's chunk id).
    """

    _METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: Sequence[_PipelineStageBase]):
        self._stages = list(stages)
        self.spans: list[ComputeSpan] = []
        self._saved: list[tuple[_PipelineStageBase, str, object]] = []

    def __enter__(self) -> "ComputeRecorder":
        for stage in self._stages:
            for name in self._METHODS:
                # None: the class's method was in use; restored by deleting ours.
                self._saved.append((stage, name, stage.__dict__.get(name)))
                setattr(stage, name, self._timed(stage, name, getattr(stage, name)))
        return self

    def __exit__(self, *exc_info) -> None:
        for stage, name, previous in reversed(self._saved):
            if previous is None:
                delattr(stage, name)
            else:
                setattr(stage, name, previous)
        self._saved.clear()

    def _timed(self, stage: _PipelineStageBase, name: str, method):
        def timed(chunk_id, *args, **kwargs):
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:
                kind = "B" if kwargs.get("full_backward", True) else "I"
            start = time.perf_counter()
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                self.spans.append(
                    ComputeSpan(stage.stage_index, kind, chunk_id, start, time.perf_counter())
                )

        return timed

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How a segment-aware layer reaches its stage's K/V store, and the one call binding them.

Softmax attention (:class:`~torchtitan_seq1f1b.attention.SegmentAwareAttention`)
and linear attention (:class:`~torchtitan_seq1f1b.linear_attention.SegmentAwareGatedDeltaNet`)
both run registered ops that find the layer and the store through a
zero-element buffer, the layer's handle (:func:`stamp_handle`): a graph
input like any other, so compiled graphs neither see the store nor guard on
it. :class:`SegmentAwareLayer` keeps that handle stamped; :func:`bind_attention`
binds every such layer of a module, whatever its kind.
"""

import torch
import torch.nn as nn

from torchtitan_seq1f1b.kv_store import KVStore

__all__ = ["SegmentAwareLayer", "bind_attention", "bound_to", "stamp_handle"]


def stamp_handle(handle: torch.Tensor, layer: nn.Module, store: KVStore | None) -> torch.Tensor:
    """Make ``handle`` stand for ``layer`` working through ``store`` (None: whole rows)."""
    handle.seq1f1b_binding = (layer, store)
    return handle


def bound_to(handle: torch.Tensor, op: str) -> tuple[nn.Module, KVStore | None]:
    """(layer, store) a handle stands for; ``op`` names the caller in the error."""
    binding = getattr(handle, "seq1f1b_binding", None)
    if binding is None:
        raise RuntimeError(f"{op} got a tensor that is no segment-aware layer's handle")
    return binding


class SegmentAwareLayer(nn.Module):
    """A layer whose calls see its microbatch's earlier segments through a K/V store.

    ``kv_store`` is the store it is bound to (None: each call is whole rows)
    and ``handle`` the buffer its ops get; each binding makes a new handle,
    so a backward keeps the one its forward saved.
    """

    def __init__(self):
        super().__init__()
        # Stands for this layer inside compiled graphs: an input, not a constant.
        self.register_buffer("handle", torch.empty(0), persistent=False)
        self.bind(None)

    def bind(self, store: KVStore | None) -> None:
        """Work through ``store`` (None: whole rows), under a new handle."""
        self.kv_store = store
        self.handle = stamp_handle(torch.empty(0, device=self.handle.device), self, store)

    # .to(), to_empty(), deepcopy and unpickling give the layer a new handle tensor.
    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        stamp_handle(self.handle, self, self.kv_store)
        return module

    def __setstate__(self, state):
        super().__setstate__(state)
        stamp_handle(self.handle, self, self.kv_store)


def bind_attention(module: nn.Module, store: KVStore | None) -> int:
    """Point every :class:`SegmentAwareLayer` inside ``module`` (softmax and linear
    attention alike) at ``store``.

    Returns how many layers were bound. A schedule binds each stage's layers
    to the stage's store; ``None`` unbinds them (whole rows: plain causal
    attention, linear attention from a zero state).
    """
    layers = [m for m in module.modules() if isinstance(m, SegmentAwareLayer)]
    for layer in layers:
        layer.bind(store)
    return len(layers)

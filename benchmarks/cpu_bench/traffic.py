# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Bytes a rank communicates in one pipeline step, counted where the calls are issued.

:class:`TrafficCounter` wraps the calls every schedule communicates through and
adds up the sizes of their tensors; it times nothing, so the counts are exact
and repeat from run to run.
"""

import torch.distributed as dist
import torch.distributed.pipelining.schedules as _schedules

from torchtitan_seq1f1b.context_parallel import ContextGroup

__all__ = ["TRAFFIC_KINDS", "TrafficCounter"]

TRAFFIC_KINDS = ("all_gather", "reduce_scatter", "pp_send", "pp_recv")


class TrafficCounter:
    """Bytes and calls per kind of communication on this rank while it is entered.

    - ``all_gather``: :meth:`ContextGroup.gather`, one per attention layer and
      segment forward; a rank sends (and receives) ``(c - 1) / c`` of the
      gathered K and V, ``(batch, L, kv_heads, head_dim)`` each.
    - ``reduce_scatter``: :meth:`ContextGroup.reduce_scatter`, one per layer and
      segment backward; a rank sends (and receives) ``(c - 1) / c`` of the
      partial dK and dV of the segment.
    - ``pp_send`` / ``pp_recv``: every tensor torch's pipeline runtime sends or
      receives, all through ``schedules._batch_p2p`` (a module global looked up
      at call time, as :func:`~torchtitan_seq1f1b._torch_compat.introspection.recorded_p2p_receives`
      relies on too).

    ``bytes[kind]`` and ``calls[kind]`` (collectives, or p2p tensors) start at 0.
    """

    def __init__(self):
        self.bytes = dict.fromkeys(TRAFFIC_KINDS, 0)
        self.calls = dict.fromkeys(TRAFFIC_KINDS, 0)
        self._saved: dict = {}

    def _add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def __enter__(self) -> "TrafficCounter":
        gather, reduce_scatter = ContextGroup.gather, ContextGroup.reduce_scatter
        batch_p2p = _schedules._batch_p2p

        def counted_gather(context, k, v):
            self._add("all_gather", (context.layout.degree - 1) * (k.nbytes + v.nbytes))
            return gather(context, k, v)

        def counted_reduce_scatter(context, grad_k, grad_v):
            degree = context.layout.degree
            self._add("reduce_scatter", (degree - 1) * (grad_k.nbytes + grad_v.nbytes) // degree)
            return reduce_scatter(context, grad_k, grad_v)

        def counted_batch_p2p(p2p_ops, *args, **kwargs):
            for op in p2p_ops:
                self._add("pp_send" if op.op is dist.isend else "pp_recv", op.tensor.nbytes)
            return batch_p2p(p2p_ops, *args, **kwargs)

        self._saved = {"gather": gather, "reduce_scatter": reduce_scatter, "batch_p2p": batch_p2p}
        ContextGroup.gather, ContextGroup.reduce_scatter = counted_gather, counted_reduce_scatter
        _schedules._batch_p2p = counted_batch_p2p
        return self

    def __exit__(self, *exc_info) -> None:
        ContextGroup.gather = self._saved["gather"]
        ContextGroup.reduce_scatter = self._saved["reduce_scatter"]
        _schedules._batch_p2p = self._saved["batch_p2p"]

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Where a segment's gated delta rule runs: fla's chunked kernel or the exact path.

Both compute :func:`.delta_rule.delta_rule_forward` and its backward on the
same arguments: q, k (B, L, HV, K) before L2 norm, v (B, L, HV, V), g, beta
(B, L, HV), the state the rows carry in (B, HV, K, V) or None, each token's
index in its document (B, L), and the segment's documents. ``"exact"`` is
the plain-torch recurrence, in any dtype on any device. ``"fla"`` is fla's
``chunk_gated_delta_rule`` (CUDA, fp16/bf16): documents starting inside a
segment become varlen sequences over the rows' tokens back to back, of
which only a row's first takes the carried state, and only when the row's
document continues across the cut; the others start at zero. A row's final
state is its last sequence's. Rows that are each one sequence run in fla's
batch mode, without varlen metadata.

``GatedDeltaNetConfig.recurrence_backend`` picks one: ``"auto"`` (fla where
it runs, else exact, as ``attention_backend="auto"``), ``"fla"`` or ``"exact"``.
"""

import functools
import logging
import weakref
from dataclasses import dataclass

import torch

from torchtitan_seq1f1b.attention import KernelTarget
from torchtitan_seq1f1b.attention.choice import first_that_runs
from torchtitan_seq1f1b.documents import SegmentDocuments
from torchtitan_seq1f1b.linear_attention import _fla
from torchtitan_seq1f1b.linear_attention.delta_rule import (
    delta_rule_backward,
    delta_rule_forward,
    DeltaRuleGrads,
)

__all__ = [
    "ExactRecurrence",
    "FlaRecurrence",
    "RECURRENCE_BACKENDS",
    "RecurrenceBackend",
    "RecurrenceLayout",
    "check_recurrence_backend",
    "recurrence_layout",
]

logger = logging.getLogger(__name__)

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLA_MAX_KEY_DIM = 256  # fla's chunk_delta_h kernels refuse larger K


class RecurrenceBackend:
    """The gated delta rule of one segment (module docstring for the arguments)."""

    name: str

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        """What this backend needs and ``target`` (q's device, dtype, K) lacks."""
        raise NotImplementedError

    def forward(self, q, k, v, g, beta, scale, initial_state, doc_positions, documents):
        """Returns o (B, L, HV, V) in v's dtype and the final state (B, HV, K, V)."""
        raise NotImplementedError

    def backward(
        self, grad_o, grad_final, q, k, v, g, beta, scale, initial_state, doc_positions, documents
    ) -> DeltaRuleGrads:
        """Gradients given grad_o (B, L, HV, V) and the final state's (B, HV, K, V) or None;
        ``initial_state``'s is zero for rows whose document starts at the cut."""
        raise NotImplementedError


class ExactRecurrence(RecurrenceBackend):
    """:mod:`.delta_rule`: token by token in the inputs' dtype, float64 included."""

    name = "exact"

    def unmet_requirements(self, target):
        return []

    def forward(self, q, k, v, g, beta, scale, initial_state, doc_positions, documents):
        return delta_rule_forward(q, k, v, g, beta, scale, initial_state, doc_positions == 0)

    def backward(
        self, grad_o, grad_final, q, k, v, g, beta, scale, initial_state, doc_positions, documents
    ):
        return delta_rule_backward(
            grad_o, grad_final, q, k, v, g, beta, scale, initial_state, doc_positions == 0
        )


@dataclass(frozen=True)
class RecurrenceLayout:
    """A segment's documents as fla's varlen sequences over its (1, B * L) tokens.

    Attributes, all int64 on the device:
        cu_seqlens: (N + 1,) where each sequence starts, then B * L.
        chunk_indices: (chunks, 2) fla's (sequence, chunk) per chunk, so fla reads no lengths.
        first, last: (B,) each row's first and last sequence.
    """

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor


# Built once per segment of a microbatch, shared by its layers and recomputes.
_LAYOUTS: "weakref.WeakKeyDictionary[SegmentDocuments, RecurrenceLayout]" = weakref.WeakKeyDictionary()


def recurrence_layout(
    documents: SegmentDocuments | None, device: torch.device, kernels=_fla
) -> RecurrenceLayout | None:
    """The segment's varlen layout, None when every row is one sequence.

    Built on the host from the documents' bounds and sent in one copy (from
    pinned memory on CUDA, not blocking the host) the first time a layer asks.
    """
    if documents is None or all(len(bounds) == 2 for bounds in documents.bounds_q):
        return None
    if documents in _LAYOUTS:
        return _LAYOUTS[documents]
    length = documents.end - documents.start
    starts, first, last = [], [], []
    for row, bounds in enumerate(documents.bounds_q):
        first.append(len(starts))
        starts.extend(row * length + b for b in bounds[:-1])
        last.append(len(starts) - 1)
    cu_seqlens = torch.tensor([*starts, len(documents.bounds_q) * length])
    chunks = kernels.chunk_indices(cu_seqlens)
    host = torch.cat((cu_seqlens, chunks.flatten(), torch.tensor(first + last)))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    sizes = (len(cu_seqlens), chunks.numel(), len(first), len(last))
    cu, chunk_indices, first, last = packed.split(sizes)
    layout = RecurrenceLayout(cu, chunk_indices.view(-1, 2), first, last)
    _LAYOUTS[documents] = layout
    return layout


class FlaRecurrence(RecurrenceBackend):
    """fla's ``chunk_gated_delta_rule`` and its backward (:mod:`._fla`).

    ``kernels`` (default :mod:`._fla`) lets tests stand in for fla: it has
    ``chunk_gated_delta_rule`` (fla's signature), ``chunk_gated_delta_rule_backward``
    and ``chunk_indices``.
    """

    name = "fla"

    def __init__(self, kernels=None):
        self._kernels = kernels

    @property
    def kernels(self):
        return _fla if self._kernels is None else self._kernels

    def unmet_requirements(self, target):
        if target.device.type != "cuda":
            return [f"a CUDA device (this runs on {target.device.type})"]
        unmet = []
        if target.dtype not in _HALF_DTYPES:
            unmet.append(f"fp16 or bf16 activations (found {target.dtype})")
        if target.head_dim > _FLA_MAX_KEY_DIM:
            unmet.append(f"key head dim <= {_FLA_MAX_KEY_DIM} (found {target.head_dim})")
        if self._kernels is None:
            unmet += _fla.unmet()
        return unmet

    def forward(self, q, k, v, g, beta, scale, initial_state, doc_positions, documents):
        layout = recurrence_layout(documents, q.device, self.kernels)
        o, final = self.kernels.chunk_gated_delta_rule(
            *_flat(layout, q, k, v, g, beta), scale=scale,
            initial_state=_initial(initial_state, doc_positions, layout),
            output_final_state=True, use_qk_l2norm_in_kernel=True, **_varlen(layout),
        )
        return o.view(v.shape), final if layout is None else final[layout.last]

    def backward(
        self, grad_o, grad_final, q, k, v, g, beta, scale, initial_state, doc_positions, documents
    ):
        layout = recurrence_layout(documents, q.device, self.kernels)
        dht = grad_final
        if layout is not None and grad_final is not None:
            # Rows hand on their last sequence's state only; the others end inside the segment.
            dht = grad_final.new_zeros(len(layout.cu_seqlens) - 1, *grad_final.shape[1:])
            dht = dht.index_copy(0, layout.last, grad_final)
        initial = _initial(initial_state, doc_positions, layout)
        dq, dk, dv, dg, dbeta, dh0 = self.kernels.chunk_gated_delta_rule_backward(
            *_flat(layout, grad_o), dht, *_flat(layout, q, k, v, g, beta), scale, initial,
            **_varlen(layout),
        )
        if dh0 is not None:
            if layout is not None:
                dh0 = dh0[layout.first]
            dh0 = torch.where(_continues(doc_positions), dh0, 0)
        shaped = (x.view(like.shape) for x, like in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta)))
        return DeltaRuleGrads(*shaped, initial_state=dh0)


def _continues(doc_positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, 1) bool: whether a row's first token continues a document from before the cut."""
    return (doc_positions[:, 0] != 0)[:, None, None, None]


def _initial(initial_state, doc_positions, layout):
    """fla's initial_state: the carried one for rows that continue, zeros elsewhere,
    one per sequence under varlen. None without a carried state."""
    if initial_state is None:
        return None
    rows = torch.where(_continues(doc_positions), initial_state, 0)
    if layout is None:
        return rows
    per_sequence = rows.new_zeros(len(layout.cu_seqlens) - 1, *rows.shape[1:])
    return per_sequence.index_copy(0, layout.first, rows)


def _flat(layout, *tensors):
    """(B, L, ...) -> (1, B * L, ...) under varlen (fla takes one batch then); else as they are."""
    return tensors if layout is None else tuple(x.flatten(0, 1)[None] for x in tensors)


def _varlen(layout) -> dict:
    if layout is None:
        return {}
    return dict(cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices)


RECURRENCE_BACKENDS: dict[str, type[RecurrenceBackend]] = {
    "fla": FlaRecurrence,
    "exact": ExactRecurrence,
}


@functools.lru_cache(maxsize=None)
def check_recurrence_backend(name: str, target: KernelTarget) -> RecurrenceBackend:
    """The backend ``recurrence_backend=name`` selects on ``target``: "auto" takes the
    first of RECURRENCE_BACKENDS that runs (logged once); a forced one that cannot
    run raises a ValueError naming what is missing."""
    if name == "auto":
        return first_that_runs(RECURRENCE_BACKENDS.values(), target, "recurrence_backend", logger)
    if name not in RECURRENCE_BACKENDS:
        raise ValueError(
            f"recurrence_backend={name!r} is unknown; choose one of {['auto', *RECURRENCE_BACKENDS]}"
        )
    backend = RECURRENCE_BACKENDS[name]()
    unmet = backend.unmet_requirements(target)
    if unmet:
        raise ValueError(
            f"recurrence_backend={name!r} cannot run on {target}: it needs {'; '.join(unmet)}. "
            "Use recurrence_backend='auto' (fla where it runs, else exact) or 'exact'"
        )
    return backend

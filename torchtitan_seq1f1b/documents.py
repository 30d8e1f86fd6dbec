# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Packed documents: which keys each segment's queries may see.

A packed sequence holds several documents back to back. Document ids are an
integer tensor (batch, seq_len), non-decreasing along each row; equal ids
form one document. A query at position t attends the keys of its own
document at or before it: positions ``[doc_start(t), t]``, a contiguous range
because ids never decrease. How ids are derived (EOS tokens, per-document
positions) is the caller's business.

Under Seq1F1B a segment ``[start, end)`` therefore needs keys from
``key_start = min over rows of doc_start(start)`` on: K/V of documents that
ended before the segment starts are never read, and K/V that no later
segment of the microbatch reads need not be kept for the next segments
(:attr:`MicrobatchDocuments.keep_from`).
"""

import functools
from dataclasses import dataclass, field

import torch

from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = [
    "MicrobatchDocuments",
    "SegmentDocuments",
    "attention_pairs",
    "check_document_ids",
    "document_starts",
    "keys_per_query",
]


def check_document_ids(ids: object, batch: int, seq_len: int) -> str | None:
    """Why ``ids`` cannot be a (batch, seq_len) document-id tensor, if it cannot."""
    if not isinstance(ids, torch.Tensor):
        return f"document ids must be a tensor, got {type(ids).__name__}"
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        return f"document ids must be an integer tensor, got dtype {ids.dtype}"
    if tuple(ids.shape) != (batch, seq_len):
        return (
            f"document ids have shape {tuple(ids.shape)}, expected (batch, seq_len) = "
            f"{(batch, seq_len)}, one id per token of the inputs"
        )
    if seq_len > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
        return (
            "document ids decrease along a row; ids must be non-decreasing "
            "(e.g. the cumulative count of document starts)"
        )
    return None


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq_len) ids -> (batch, seq_len) int64: where each token's document starts."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values


def keys_per_query(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq_len) ids -> (batch, seq_len) int64: the keys each query sees, ``t - doc_start(t) + 1``.

    Raises ValueError for ids :func:`check_document_ids` refuses.
    """
    batch = ids.shape[0] if ids.dim() == 2 else -1
    error = check_document_ids(ids, batch, ids.shape[-1])
    if error is not None:
        raise ValueError(error)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return positions - document_starts(ids) + 1


def attention_pairs(ids: torch.Tensor, start: int, end: int) -> int:
    """(query, key) pairs the document mask allows for queries in ``[start, end)``, over all rows.

    This is the work a varlen kernel does; dense causal attention over the
    prefix does ``rows * sum(t + 1 for t in range(start, end))``.
    """
    doc_start = document_starts(ids)[:, start:end]
    positions = torch.arange(start, end, device=ids.device)
    return int((positions - doc_start + 1).sum())


@dataclass(frozen=True, eq=False)
class SegmentDocuments:
    """The document layout one segment's attention needs.

    Keys passed to a kernel are positions ``[key_start, end)``; queries are
    ``[start, end)``. Row b's documents meeting the segment give varlen
    metadata over ``q[b]`` (queries from ``start``) and ``k[b,
    key_offset(b):]`` (keys from the row's first needed key): document d has
    queries ``[bounds_q[b][d], bounds_q[b][d+1])`` and keys ``[bounds_k[b][d],
    bounds_k[b][d+1])``, its causal mask aligned bottom-right.

    Attributes:
        start, end: the segment's positions.
        key_start: first key position any row's queries see.
        query_doc_start: (batch, end - start) int64, absolute start of each
            query's document.
        row_key_start: per row, the start of the document at ``start``.
        bounds_q, bounds_k: per row, cumulative query and key counts per document.
    """

    start: int
    end: int
    key_start: int
    query_doc_start: torch.Tensor
    row_key_start: tuple[int, ...]
    bounds_q: tuple[tuple[int, ...], ...]
    bounds_k: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, doc_starts: torch.Tensor, start: int, end: int) -> "SegmentDocuments":
        """From :func:`document_starts` of a microbatch (batch, seq_len)."""
        query_doc_start = doc_starts[:, start:end]
        rows = query_doc_start.tolist()  # one host sync per unit, shared by every layer
        row_key_start, bounds_q, bounds_k = [], [], []
        for row in rows:
            # Query index where each document of the segment begins.
            firsts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
            key_base = row[0]
            row_key_start.append(key_base)
            bounds_q.append(tuple(firsts) + (end - start,))
            bounds_k.append((0, *(start + i - key_base for i in firsts[1:]), end - key_base))
        return cls(
            start=start,
            end=end,
            key_start=min(row_key_start),
            query_doc_start=query_doc_start,
            row_key_start=tuple(row_key_start),
            bounds_q=tuple(bounds_q),
            bounds_k=tuple(bounds_k),
        )

    def key_offset(self, row: int) -> int:
        """Index of the row's first needed key among the keys ``[key_start, end)``."""
        return self.row_key_start[row] - self.key_start

    def documents(self, row: int) -> list[tuple[slice, slice]]:
        """(query slice, key slice) of each document of ``row``; keys from :meth:`key_offset`."""
        q, k = self.bounds_q[row], self.bounds_k[row]
        return [
            (slice(q[d], q[d + 1]), slice(k[d], k[d + 1])) for d in range(len(q) - 1)
        ]

    def varlen_metadata(self, row: int, device: torch.device) -> tuple:
        """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of ``row``, int32."""
        q, k = self.bounds_q[row], self.bounds_k[row]
        return (
            torch.tensor(q, dtype=torch.int32, device=device),
            torch.tensor(k, dtype=torch.int32, device=device),
            max(b - a for a, b in zip(q, q[1:])),
            max(b - a for a, b in zip(k, k[1:])),
        )

    def key_mask(self) -> torch.Tensor:
        """(batch, 1, end - start, end - key_start) bool: which keys each query sees.

        Built on demand from ``query_doc_start`` (O(queries) state), so a
        kernel that needs a dense mask rebuilds it in backward instead of saving it.
        """
        keys = torch.arange(self.key_start, self.end, device=self.query_doc_start.device)
        queries = torch.arange(self.start, self.end, device=keys.device)
        own_document = keys[None, None, :] >= self.query_doc_start[:, :, None]
        causal = keys[None, None, :] <= queries[None, :, None]
        return (own_document & causal)[:, None]


@dataclass(eq=False)
class MicrobatchDocuments:
    """One microbatch's documents under a segment plan; segments are built once, on demand.

    Args:
        ids: (batch, seq_len) document ids of the microbatch.
        plan: how its sequence is cut.
    """

    ids: torch.Tensor
    plan: SegmentPlan
    _starts: torch.Tensor = field(init=False, repr=False)
    _segments: dict[int, SegmentDocuments] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._starts = document_starts(self.ids)

    def segment(self, j: int) -> SegmentDocuments:
        if j not in self._segments:
            self._segments[j] = SegmentDocuments.of(
                self._starts, self.plan.offsets[j], self.plan.ends[j]
            )
        return self._segments[j]

    @functools.cached_property
    def keep_from(self) -> int:
        """First position a later segment reads back from the K/V store.

        A segment whose documents all start inside it reads nothing back;
        keys before ``keep_from`` are read only by the segment that computes
        them, so the store never holds them. ``seq_len`` when nothing is read back.
        """
        reads = [
            key_start
            for key_start, start in ((int(self._starts[:, s].min()), s) for s in self.plan.offsets[1:])
            if key_start < start
        ]
        return min(reads, default=self.plan.seq_len)

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

A sliding-window layer lays segments out the same way, each query also
seeing at most ``window_left`` keys before it (:meth:`MicrobatchDocuments.segment`);
rows without documents are then one document each (:meth:`MicrobatchDocuments.whole_rows`).

Layouts are built on the host from where documents start, read from the
device once per step for all microbatches (:func:`read_document_starts`);
the varlen metadata of every segment goes back in one upload
(:func:`upload_varlen_layouts`), shared by every layer and by recompute.
"""

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = [
    "MicrobatchDocuments",
    "PackedVarlen",
    "SegmentDocuments",
    "attention_pairs",
    "check_document_ids",
    "document_starts",
    "keys_per_query",
    "read_document_starts",
    "upload_varlen_layouts",
]

_DECREASING = (
    "document ids decrease along a row; ids must be non-decreasing "
    "(e.g. the cumulative count of document starts)"
)


def check_document_ids(ids: object, batch: int, seq_len: int) -> str | None:
    """Why ``ids`` cannot be a (batch, seq_len) document-id tensor, if it cannot.

    Checks type, dtype and shape only, without reading the device; the order
    of the ids is checked where they are read (:func:`read_document_starts`).
    """
    if not isinstance(ids, torch.Tensor):
        return f"document ids must be a tensor, got {type(ids).__name__}"
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        return f"document ids must be an integer tensor, got dtype {ids.dtype}"
    if tuple(ids.shape) != (batch, seq_len):
        return (
            f"document ids have shape {tuple(ids.shape)}, expected (batch, seq_len) = "
            f"{(batch, seq_len)}, one id per token of the inputs"
        )
    return None


RowStarts = tuple[int, ...]


def read_document_starts(ids: Sequence[torch.Tensor]) -> list[list[RowStarts]] | str:
    """Where documents start in each row of each (rows, seq_len) tensor, read in one go.

    Returns, per tensor and row, the ascending positions where a document
    starts (0 first), or why the ids are not non-decreasing. All tensors are
    compared on their device and only the positions where ids change cross
    to the host: one device read per call, whatever the rows and documents.
    """
    seq_len = ids[0].shape[-1]
    rows = torch.cat([x.reshape(-1, seq_len) for x in ids])
    step = rows[:, 1:] - rows[:, :-1]
    # (row, position - 1, kind): kind 0 where a document starts, 1 where ids decrease.
    changes = torch.stack((step != 0, step < 0), dim=-1).nonzero().tolist()
    if any(kind for _, _, kind in changes):
        return _DECREASING
    starts: list[list[int]] = [[0] for _ in range(rows.shape[0])]
    for row, position, _ in changes:
        starts[row].append(position + 1)
    out, first = [], 0
    for x in ids:
        count = x.numel() // max(seq_len, 1)
        out.append([tuple(s) for s in starts[first : first + count]])
        first += count
    return out


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq_len) ids -> (batch, seq_len) int64: where each token's document starts."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values


def keys_per_query(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq_len) ids -> (batch, seq_len) int64: the keys each query sees, ``t - doc_start(t) + 1``.

    Raises ValueError for ids :func:`check_document_ids` or
    :func:`read_document_starts` refuses.
    """
    batch = ids.shape[0] if ids.dim() == 2 else -1
    error = check_document_ids(ids, batch, ids.shape[-1])
    if error is None and isinstance(read_document_starts([ids]), str):
        error = _DECREASING
    if error is not None:
        raise ValueError(error)
    return _keys_seen(ids)


def _keys_seen(ids: torch.Tensor) -> torch.Tensor:
    """:func:`keys_per_query` of ids already checked (or only counted)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return positions - document_starts(ids) + 1


def attention_pairs(ids: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Per ``(start, end)`` of ``spans``: the (query, key) pairs the document mask allows
    for queries in ``[start, end)`` of (batch, seq_len) ``ids``, over all rows.

    This is the work a varlen kernel does; dense causal attention over the
    prefix does ``rows * sum(t + 1 for t in range(start, end))``.
    """
    per_position = _keys_seen(ids).sum(dim=0)
    return [int(per_position[start:end].sum()) for start, end in spans]


@dataclass(frozen=True)
class PackedVarlen:
    """One varlen call for a segment's rows, with keys read from a K/V buffer in place.

    Queries are the rows' tokens back to back, (batch * Lq, ...). Keys are
    the K/V view (batch, Lk, ...) read as one token sequence whose rows lie
    ``key_row_stride`` tokens apart, (batch - 1) * key_row_stride + Lk
    tokens: the buffer positions between two rows' keys form sequences with no
    queries. Their key gradients fall outside the rows' keys, except a row's
    first :attr:`SegmentDocuments.unread_keys`, which are set to zero.

    Attributes:
        cu_seqlens_q, cu_seqlens_k: (sequences + 1,) int32 on the device,
            distinct tensors.
        max_seqlen_q, max_seqlen_k: the longest sequence's queries and keys.
        key_row_stride: tokens between rows of the K/V the layout is for.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    key_row_stride: int


@dataclass(eq=False)
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
        row_key_start: per row, the start of the document at ``start``.
        bounds_q, bounds_k: per row, cumulative query and key counts per document.
        varlen: the packed layout for one varlen call, once uploaded.
    """

    start: int
    end: int
    key_start: int
    row_key_start: tuple[int, ...]
    bounds_q: tuple[tuple[int, ...], ...]
    bounds_k: tuple[tuple[int, ...], ...]
    microbatch: "MicrobatchDocuments" = field(repr=False)
    window_left: int | None = None
    varlen: PackedVarlen | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls,
        row_starts: Sequence[RowStarts],
        start: int,
        end: int,
        microbatch: "MicrobatchDocuments",
        window_left: int | None = None,
    ) -> "SegmentDocuments":
        """From each row's document starts (host ints, ascending, 0 first); with
        ``window_left``, each query also sees at most that many keys before it."""
        row_key_start, bounds_q, bounds_k = [], [], []
        for starts in row_starts:
            first = bisect.bisect_right(starts, start) - 1
            inside = starts[first + 1 : bisect.bisect_left(starts, end)]
            key_base = starts[first]
            if window_left is not None:
                key_base = max(key_base, start - window_left)
            row_key_start.append(key_base)
            bounds_q.append((0, *(s - start for s in inside), end - start))
            bounds_k.append((0, *(s - key_base for s in inside), end - key_base))
        return cls(
            start=start,
            end=end,
            key_start=min(row_key_start),
            row_key_start=tuple(row_key_start),
            bounds_q=tuple(bounds_q),
            bounds_k=tuple(bounds_k),
            microbatch=microbatch,
            window_left=window_left,
        )

    @functools.cached_property
    def dense(self) -> bool:
        """Every row's queries lie in one document that starts at ``key_start``, and
        no window cuts a query's keys: plain bottom-right causal attention over
        the keys ``[key_start, end)``."""
        windowless = self.window_left is None or self.end - 1 - self.window_left <= self.key_start
        return (
            windowless
            and all(len(b) == 2 for b in self.bounds_q)
            and all(s == self.key_start for s in self.row_key_start)
        )

    @functools.cached_property
    def unread_keys(self) -> tuple[tuple[int, int], ...]:
        """(row, n) for each row whose first n keys of ``[key_start, end)`` no query reads."""
        return tuple((row, n) for row in range(len(self.row_key_start)) if (n := self.key_offset(row)))

    def key_offset(self, row: int) -> int:
        """Index of the row's first needed key among the keys ``[key_start, end)``."""
        return self.row_key_start[row] - self.key_start

    def documents(self, row: int) -> list[tuple[slice, slice]]:
        """(query slice, key slice) of each document of ``row``; keys from :meth:`key_offset`."""
        q, k = self.bounds_q[row], self.bounds_k[row]
        return [
            (slice(q[d], q[d + 1]), slice(k[d], k[d + 1])) for d in range(len(q) - 1)
        ]

    def packed_lengths(self, key_row_stride: int) -> tuple[list[int], list[int]]:
        """Per sequence of the packed call, its query and key counts (see :class:`PackedVarlen`)."""
        q_lens, k_lens, cursor = [], [], 0
        for row, (q, k) in enumerate(zip(self.bounds_q, self.bounds_k)):
            gap = row * key_row_stride + self.key_offset(row) - cursor
            if gap:
                q_lens.append(0)
                k_lens.append(gap)
            q_lens.extend(b - a for a, b in zip(q, q[1:]))
            k_lens.extend(b - a for a, b in zip(k, k[1:]))
            cursor = row * key_row_stride + self.end - self.key_start
        return q_lens, k_lens

    def upload_varlen(self, device: torch.device, key_row_stride: int) -> PackedVarlen:
        """This segment's :class:`PackedVarlen` for keys ``key_row_stride`` tokens
        apart, uploaded alone: for layouts :func:`upload_varlen_layouts` did not foresee."""
        _upload([(self, key_row_stride)], device)
        return self.varlen

    def key_mask(self) -> torch.Tensor:
        """(batch, 1, end - start, end - key_start) bool: which keys each query sees.

        Built on demand on the ids' device from each query's document start,
        so a kernel that needs a dense mask rebuilds it in backward instead of saving it.
        """
        query_doc_start = self.microbatch.device_starts[:, self.start : self.end]
        keys = torch.arange(self.key_start, self.end, device=query_doc_start.device)
        queries = torch.arange(self.start, self.end, device=keys.device)
        own_document = keys[None, None, :] >= query_doc_start[:, :, None]
        causal = keys[None, None, :] <= queries[None, :, None]
        if self.window_left is not None:
            causal = causal & (keys[None, None, :] >= queries[None, :, None] - self.window_left)
        return (own_document & causal)[:, None]


@dataclass(eq=False)
class MicrobatchDocuments:
    """One microbatch's documents under a segment plan; segments are built once, on demand.

    Args:
        ids: (batch, seq_len) document ids of the microbatch.
        plan: how its sequence is cut.
        row_starts: per row, where documents start, as
            :func:`read_document_starts` gives them; read from ``ids`` if None.
    """

    ids: torch.Tensor
    plan: SegmentPlan
    row_starts: list[RowStarts] | None = None
    _segments: dict[tuple[int, int | None], SegmentDocuments] = field(
        init=False, repr=False, default_factory=dict
    )
    _spans: dict[tuple[int, int, int | None], SegmentDocuments] = field(
        init=False, repr=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.row_starts is None:
            starts = read_document_starts([self.ids])
            if isinstance(starts, str):
                raise ValueError(starts)
            self.row_starts = starts[0]

    @classmethod
    def whole_rows(cls, batch: int, plan: SegmentPlan, device: torch.device) -> "MicrobatchDocuments":
        """Each row one document: causal attention, as sliding-window layers lay it out."""
        return _whole_rows(batch, plan, torch.device(device))

    def segment(self, j: int, window_left: int | None = None) -> SegmentDocuments:
        """Segment ``j``'s layout; with ``window_left``, a sliding-window layer's."""
        if (j, window_left) not in self._segments:
            self._segments[j, window_left] = SegmentDocuments.of(
                self.row_starts, self.plan.offsets[j], self.plan.ends[j], self, window_left
            )
        return self._segments[j, window_left]

    def span(self, start: int, end: int, window_left: int | None = None) -> SegmentDocuments:
        """The layout of queries ``[start, end)``, which need not be a segment of the
        plan (a head-tail piece of one under context parallelism); with
        ``window_left``, a sliding-window layer's."""
        if (start, end, window_left) not in self._spans:
            self._spans[start, end, window_left] = SegmentDocuments.of(
                self.row_starts, start, end, self, window_left
            )
        return self._spans[start, end, window_left]

    @functools.cached_property
    def device_starts(self) -> torch.Tensor:
        """(batch, seq_len) int64 on the ids' device: :func:`document_starts` of the ids."""
        return document_starts(self.ids)

    @functools.cached_property
    def single_tokens_merged(self) -> "MicrobatchDocuments":
        """These documents with each one-token document but a row's first joined to the
        one before it: a start must be followed by a token of its own document."""
        last = self.plan.seq_len - 1
        row_starts = [
            tuple(s for s, following in zip(starts, (*starts[1:], None))
                  if s == 0 or (s < last and following != s + 1))
            for starts in self.row_starts
        ]
        if row_starts == self.row_starts:
            return self
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        followed = torch.ones_like(starts)
        followed[:, :-1] = starts[:, 1:]
        kept = starts & ~followed
        kept[:, 0] = True
        return MicrobatchDocuments(kept.cumsum(dim=1) - 1, self.plan, row_starts)

    @functools.cached_property
    def keep_from(self) -> int:
        """First position a later segment reads back from the K/V store.

        A segment whose documents all start inside it reads nothing back;
        keys before ``keep_from`` are read only by the segment that computes
        them, so the store never holds them. ``seq_len`` when nothing is read back.
        """
        reads = [
            self.segment(j).key_start
            for j in range(1, len(self.plan.lengths))
            if self.segment(j).key_start < self.plan.offsets[j]
        ]
        return min(reads, default=self.plan.seq_len)

    def key_row_stride(self, j: int) -> int:
        """Tokens between rows of the keys segment ``j`` attends: the K/V
        store's rows, or the segment's own K/V when it reads nothing back."""
        segment = self.segment(j)
        if segment.key_start >= self.keep_from:
            return self.plan.seq_len - self.keep_from
        return segment.end - segment.start


@functools.lru_cache(maxsize=16)
def _whole_rows(batch: int, plan: SegmentPlan, device: torch.device) -> MicrobatchDocuments:
    ids = torch.zeros((batch, plan.seq_len), dtype=torch.int64, device=device)
    return MicrobatchDocuments(ids, plan, [(0,)] * batch)


def upload_varlen_layouts(
    microbatches: Sequence[MicrobatchDocuments],
    device: torch.device,
    windows: Sequence[int] = (),
) -> None:
    """Give every segment that is not :attr:`~SegmentDocuments.dense` its
    :class:`PackedVarlen`, in one host-to-device copy for all of them; also its
    layout under each sliding window in ``windows`` (``window_left`` values),
    whose keys a kernel reads as one contiguous tensor."""
    segments = []
    for documents in microbatches:
        for j in range(len(documents.plan.lengths)):
            segments.append((documents.segment(j), documents.key_row_stride(j)))
            for window_left in windows:
                windowed = documents.segment(j, window_left)
                segments.append((windowed, windowed.end - windowed.key_start))
    _upload([(segment, stride) for segment, stride in segments if not segment.dense], device)


def _upload(segments: list[tuple[SegmentDocuments, int]], device: torch.device) -> None:
    """Set each segment's ``varlen`` for its key row stride; on CUDA the one
    copy leaves from pinned memory without blocking the host."""
    if not segments:
        return
    lengths = [segment.packed_lengths(stride) for segment, stride in segments]
    host = []
    for q_lens, k_lens in lengths:
        for lens in (q_lens, k_lens):
            host.append(0)
            for n in lens:
                host.append(host[-1] + n)
    packed = torch.tensor(host, dtype=torch.int32)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    offset = 0
    for (segment, stride), (q_lens, k_lens) in zip(segments, lengths):
        n = len(q_lens) + 1
        segment.varlen = PackedVarlen(
            cu_seqlens_q=packed[offset : offset + n],
            cu_seqlens_k=packed[offset + n : offset + 2 * n],
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
            key_row_stride=stride,
        )
        offset += 2 * n

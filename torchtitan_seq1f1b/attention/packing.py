# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Packed documents into a kernel: dense kernels once per document, varlen kernels once.

Shapes are the backends' (:mod:`~torchtitan_seq1f1b.attention.backend`):
q (batch, Lq, n_heads, head_dim), k and v (batch, Lk, n_kv_heads, head_dim)
holding the positions ``[documents.key_start, documents.end)``. Each way
comes twice: through autograd (the kernel's entry point differentiates
itself), and as an explicit forward and backward for the registered op,
which runs below autograd. A forward returns the output and the logsumexp
(batch, n_heads, Lq).
"""

from collections.abc import Callable, Iterator

import torch

from torchtitan_seq1f1b.documents import PackedVarlen, SegmentDocuments

__all__ = [
    "packed_varlen",
    "packed_varlen_backward",
    "packed_varlen_forward",
    "per_document",
    "per_document_backward",
    "per_document_forward",
]

DenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]
VarlenKernel = Callable[..., torch.Tensor]


def _document_slices(batch: int, documents: SegmentDocuments) -> Iterator[tuple[int, slice, slice]]:
    """(row, query slice, key slice into k/v) of every document of every row."""
    for row in range(batch):
        offset = documents.key_offset(row)
        for queries, keys in documents.documents(row):
            yield row, queries, slice(offset + keys.start, offset + keys.stop)


def per_document(
    kernel: DenseKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
    documents: SegmentDocuments,
) -> torch.Tensor:
    """A dense bottom-right kernel run on every document of every row; shapes as the module's."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    for row, queries, keys in _document_slices(q.shape[0], documents):
        one = slice(row, row + 1)
        rows[row].append(kernel(q[one, queries], k[one, keys], v[one, keys], scale))
    return torch.cat([torch.cat(pieces, dim=1) for pieces in rows], dim=0)


def per_document_forward(forward: Callable, q, k, v, scale: float, documents: SegmentDocuments):
    """``forward(q, k, v, scale) -> (out, lse)`` of a dense kernel on every document."""
    outs: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    lses: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    for row, queries, keys in _document_slices(q.shape[0], documents):
        one = slice(row, row + 1)
        out, lse = forward(q[one, queries], k[one, keys], v[one, keys], scale)
        outs[row].append(out)
        lses[row].append(lse)
    return (
        torch.cat([torch.cat(pieces, dim=1) for pieces in outs]),
        torch.cat([torch.cat(pieces, dim=2) for pieces in lses]),
    )


def per_document_backward(
    backward: Callable, grad, q, k, v, out, lse, scale: float, documents: SegmentDocuments
):
    """``backward(grad, q, k, v, out, lse, scale) -> (dq, dk, dv)`` on every document;
    keys no query reads get a zero gradient."""
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, queries, keys in _document_slices(q.shape[0], documents):
        one = slice(row, row + 1)
        dq, dk, dv = backward(
            grad[one, queries], q[one, queries], k[one, keys], v[one, keys], out[one, queries],
            lse[one, :, queries], scale,
        )
        grad_q[one, queries], grad_k[one, keys], grad_v[one, keys] = dq, dk, dv
    return grad_q, grad_k, grad_v


def _row_stride(x: torch.Tensor) -> int | None:
    """Tokens between x's rows, if its rows lie on one token grid."""
    if x.shape[0] == 1:
        return x.shape[1]
    if x.stride(1) > 0 and x.stride(0) % x.stride(1) == 0 and x.stride(0) >= x.stride(1) * x.shape[1]:
        return x.stride(0) // x.stride(1)
    return None


def _on_token_grid(q, k, v, documents: SegmentDocuments):
    """(k, v, row stride in tokens, layout): k and v as they are when their rows lie on
    one token grid, else contiguous copies; the varlen layout for that stride."""
    stride = _row_stride(k)
    if stride is None or stride != _row_stride(v) or k.stride()[1:] != v.stride()[1:]:
        k, v = k.contiguous(), v.contiguous()
        stride = k.shape[1]
    layout = documents.varlen
    # One row has no gaps: any layout fits it.
    if layout is None or (k.shape[0] > 1 and layout.key_row_stride != stride):
        layout = documents.upload_varlen(q.device, stride)
    return k, v, stride, layout


def _as_tokens(x: torch.Tensor, row_stride: int) -> torch.Tensor:
    """(batch, L, heads, head_dim) rows ``row_stride`` tokens apart -> one
    ((batch - 1) * row_stride + L, heads, head_dim) token sequence, without a copy."""
    tokens = (x.shape[0] - 1) * row_stride + x.shape[1]
    return x.as_strided((tokens, *x.shape[2:]), x.stride()[1:])


def _tokens_as_rows(grad: torch.Tensor, shape, row_stride: int, unread) -> torch.Tensor:
    """The inverse of :func:`_as_tokens` for a gradient; keys in ``unread`` ((row, n):
    a row's first n keys belong to no query) are set to zero, whatever the kernel wrote."""
    strides = (row_stride * grad.stride(0), *grad.stride())
    rows = grad.as_strided(shape, strides, grad.storage_offset())
    for row, n in unread:
        rows[row, :n].zero_()
    return rows


class _RowsAsTokens(torch.autograd.Function):
    """:func:`_as_tokens` with its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row_stride: int, unread: tuple) -> torch.Tensor:
        ctx.shape, ctx.row_stride, ctx.unread = x.shape, row_stride, unread
        return _as_tokens(x, row_stride)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _tokens_as_rows(grad, ctx.shape, ctx.row_stride, ctx.unread), None, None


def _layout_args(layout: PackedVarlen) -> tuple:
    return layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q, layout.max_seqlen_k


def packed_varlen(
    kernel: VarlenKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    documents: SegmentDocuments,
) -> torch.Tensor:
    """``kernel(q_tokens, k_tokens, v_tokens, cu_seqlens_q, cu_seqlens_k, max_q, max_k)``
    once for all rows (:class:`~torchtitan_seq1f1b.documents.PackedVarlen`).

    q_tokens: (batch * Lq, n_heads, head_dim); k_tokens, v_tokens: k and v
    read in place as one token sequence. Returns (batch, Lq, n_heads, head_dim).
    """
    k, v, stride, layout = _on_token_grid(q, k, v, documents)
    batch, q_len = q.shape[:2]
    out = kernel(
        q.reshape(batch * q_len, *q.shape[2:]),
        _RowsAsTokens.apply(k, stride, documents.unread_keys),
        _RowsAsTokens.apply(v, stride, documents.unread_keys),
        *_layout_args(layout),
    )
    return out.view(batch, q_len, *out.shape[1:])


def packed_varlen_forward(forward: Callable, q, k, v, documents: SegmentDocuments):
    """:func:`packed_varlen` with ``forward(...) -> (out (batch * Lq, n_heads, head_dim),
    lse (n_heads, batch * Lq))``; returns out and lse in the backends' shapes."""
    k, v, stride, layout = _on_token_grid(q, k, v, documents)
    batch, q_len = q.shape[:2]
    out, lse = forward(
        q.reshape(batch * q_len, *q.shape[2:]), _as_tokens(k, stride), _as_tokens(v, stride),
        *_layout_args(layout),
    )
    return out.view(q.shape), lse.view(-1, batch, q_len).transpose(0, 1).contiguous()


def packed_varlen_backward(backward: Callable, grad, q, k, v, out, lse, documents: SegmentDocuments):
    """(dq, dk, dv) of :func:`packed_varlen_forward`, with ``backward(grad, q, k, v, out,
    lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k) -> (dq, dk, dv)`` on the packed tokens."""
    k, v, stride, layout = _on_token_grid(q, k, v, documents)
    batch, q_len = q.shape[:2]

    def tokens(x):
        return x.reshape(batch * q_len, *x.shape[2:])

    dq, dk, dv = backward(
        tokens(grad), tokens(q), _as_tokens(k, stride), _as_tokens(v, stride), tokens(out),
        lse.transpose(0, 1).reshape(lse.shape[1], batch * q_len), *_layout_args(layout),
    )
    unread = documents.unread_keys
    return (
        dq.view(q.shape),
        _tokens_as_rows(dk, k.shape, stride, unread),
        _tokens_as_rows(dv, v.shape, stride, unread),
    )

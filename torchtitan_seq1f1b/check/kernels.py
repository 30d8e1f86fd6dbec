# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Attention kernels on a segment attending to its prefix, against exact attention.

Each backend gets the same inputs, rounded to its dtype; the reference is
plain masked-softmax attention in float64 on those rounded values, so every
difference is the kernel's own (its masking, GQA, prefix handling, rounding).
The segment after a prefix also runs with packed documents (the varlen
entry points of the flash kernels), rows with different layouts, and with a
sliding window (gpt_oss's), alone and within the documents. Each
backend runs twice: through its autograd entry points (eager blocks) and
through the explicit forward and backward the registered op calls
(compiled blocks, rows ``kernel-op``). Then GatedDeltaNet's fla recurrence
in a segmented layer (:mod:`~torchtitan_seq1f1b.check.gated_delta_net`).
"""

import math

import torch

from torchtitan_seq1f1b.attention import KernelTarget, resolve_backend
from torchtitan_seq1f1b.check import relative_error, Result, run_tasks, Task
from torchtitan_seq1f1b.check.gated_delta_net import fla_layer_task
from torchtitan_seq1f1b.documents import MicrobatchDocuments, SegmentDocuments
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["kernel_results", "kernel_tasks", "reference_attention"]

N_HEADS, N_KV_HEADS = 8, 2  # GQA: 4 query heads per K/V head
# (q_len, k_len): a segment after a 160-token prefix, and a first segment.
SHAPES = ((96, 256), (96, 96))
# Per row (rows take them in turn), document lengths over the 256 positions of
# the segment after a prefix: documents crossing into it and ending in it, and
# one document over everything.
DOCUMENTS = ((100, 100, 56), (256,))
# Keys before each query a sliding window lets it see: fewer than the prefix holds.
WINDOW_LEFT = 47
# Layouts of the segment after a prefix besides plain causal: (packed documents, window).
LAYOUTS = ((True, None), (False, WINDOW_LEFT), (True, WINDOW_LEFT))
HEAD_DIMS = (64, 128)
BATCHES = (1, 2)
DTYPES = {
    "flash": (torch.bfloat16,),
    "varlen": (torch.bfloat16,),
    "sdpa": (torch.bfloat16, torch.float64),
}
# Bounds on the norm-wise relative error of output, dq, dk and dv. bf16 keeps
# 8 significant bits: rounding costs up to 2^-9 per entry, ~1.1e-3 norm-wise
# (2^-9 / sqrt(3)), which is what rounding the exact result to bf16 alone
# gives. Kernels also round the softmax probabilities and dS to bf16 before
# their matmuls, a few roundings more; 2^-6 ~ 1.6e-2 leaves room for them,
# and a wrong mask or a missing prefix is off by O(0.1-1). float64 differs
# from the reference in summation order only.
BOUNDS = {torch.bfloat16: 2**-6, torch.float64: 1e-12}


def reference_attention(q, k, v, scale=None, visible=None):
    """Bottom-right causal attention, (B, Lq, H, D) x (B, Lk, Hkv, D) -> (B, Lq, H, D).

    Query t of Lq sees keys 0..Lk-Lq+t, or those ``visible`` (B, 1, Lq, Lk)
    allows; query heads h share K/V head h // (H / Hkv). Computes in the
    inputs' dtype (float64 here).
    """
    q_len, n_heads, head_dim = q.shape[1:]
    k_len, n_kv_heads = k.shape[1:3]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=2)
    v = v.repeat_interleave(n_heads // n_kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    last_visible = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    hidden = torch.arange(k_len, device=q.device)[None, :] > last_visible
    if visible is not None:
        hidden = ~visible
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(hidden, -math.inf).softmax(-1), v)


def _inputs(batch, q_len, k_len, head_dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, q_len, N_HEADS, head_dim),
        (batch, k_len, N_KV_HEADS, head_dim),
        (batch, k_len, N_KV_HEADS, head_dim),
        (batch, q_len, N_HEADS, head_dim),  # gradient of the output
    ]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]


def _output_and_grads(fn, q, k, v, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _segment_documents(
    batch: int, q_len: int, k_len: int, device, packed: bool, window_left: int | None
) -> SegmentDocuments:
    """The layout of the segment after a prefix: packed documents or one per row, and a window."""
    plan = SegmentPlan.from_lengths((k_len - q_len, q_len))
    if not packed:
        return MicrobatchDocuments.whole_rows(batch, plan, device).segment(1, window_left)
    layouts = [DOCUMENTS[row % len(DOCUMENTS)] for row in range(batch)]
    ids = torch.tensor(
        [[doc for doc, n in enumerate(lengths) for _ in range(n)] for lengths in layouts],
        device=device,
    )
    return MicrobatchDocuments(ids, plan).segment(1, window_left)


class _AsTheOp(torch.autograd.Function):
    """A backend's explicit forward and backward, as the registered op calls them."""

    @staticmethod
    def forward(ctx, q, k, v, backend, documents):
        scale = q.shape[-1] ** -0.5
        out, lse = backend.forward(q, k, v, scale, documents)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale, ctx.documents = backend, scale, documents
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.backend.backward(grad.contiguous(), *ctx.saved_tensors, ctx.scale, ctx.documents)
        return *grads, None, None


def _worst_error(backend, head_dim, dtype, device, as_op: bool) -> tuple[float, str]:
    worst, where = 0.0, ""
    cases = [(*shape, None) for shape in SHAPES] + [(*SHAPES[0], layout) for layout in LAYOUTS]
    for batch in BATCHES:
        for q_len, k_len, layout in cases:
            q, k, v, grad_out = _inputs(batch, q_len, k_len, head_dim, dtype, device, seed=batch)
            documents, visible = None, None
            if layout is not None:
                documents = _segment_documents(batch, q_len, k_len, device, *layout)
                k, v = k[:, documents.key_start :], v[:, documents.key_start :]
                visible = documents.key_mask()
            if as_op:
                actual = _output_and_grads(
                    lambda *x: _AsTheOp.apply(*x, backend, documents), q, k, v, grad_out
                )
            else:
                actual = _output_and_grads(
                    lambda *x: backend(*x, None, documents), q, k, v, grad_out
                )
            expected = _output_and_grads(
                lambda *x: reference_attention(*x, visible=visible),
                *(x.double() for x in (q, k, v, grad_out)),
            )
            for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
                error = relative_error(a, e)
                if not error <= worst:  # NaN counts as worst
                    worst, where = error, f"{name} b{batch} {q_len}/{k_len}{_describe(layout)}"
    return worst, where


def _describe(layout) -> str:
    if layout is None:
        return ""
    packed, window_left = layout
    return (" documents" if packed else "") + (f" window {window_left}" if window_left else "")


def _row_name(name: str, head_dim: int, dtype: torch.dtype, as_op: bool) -> str:
    return f"kernel{'-op' if as_op else ''} {name} {str(dtype).removeprefix('torch.')} d{head_dim}"


def check_kernel(
    name: str, head_dim: int, dtype: torch.dtype, device: torch.device, as_op: bool = False
) -> Result:
    """One backend in one dtype and head dim, over batch 1 and 2, with and without prefix;
    through its entry points, or ``as_op`` through the op's forward and backward."""
    row = _row_name(name, head_dim, dtype, as_op)
    backend = resolve_backend(name)
    probe = torch.empty(1, 1, N_HEADS, head_dim, dtype=dtype, device=device)
    if not backend.supports(probe):
        unmet = backend.unmet_requirements(KernelTarget.of(probe))
        return Result(row, "skip", reason="needs " + "; ".join(unmet))
    try:
        error, where = _worst_error(backend, head_dim, dtype, device, as_op)
    except Exception as crash:  # noqa: BLE001 - reported as a failed row
        return Result(row, "fail", reason=f"{type(crash).__name__}: {crash}")
    return Result.bounded(row, error, BOUNDS[dtype], worst=where)


def _task(name: str, head_dim: int, dtype: torch.dtype, device: torch.device, as_op: bool) -> Task:
    row = _row_name(name, head_dim, dtype, as_op)
    return Task((row,), lambda: [check_kernel(name, head_dim, dtype, device, as_op)])


def kernel_tasks(device: torch.device) -> list[Task]:
    """One task per row: backend x dtype x head dim, through autograd, then as the op;
    then GatedDeltaNet's fla layer."""
    return [
        _task(name, head_dim, dtype, device, as_op)
        for as_op in (False, True)
        for name, dtypes in DTYPES.items()
        for dtype in dtypes
        for head_dim in HEAD_DIMS
    ] + [fla_layer_task(device)]


def kernel_results(device: torch.device) -> list[Result]:
    return run_tasks(kernel_tasks(device))

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch's CUDA memory-efficient attention kernel, bottom-right causal, mask-free.

SDPA with an explicit (Lq, Lk) bool mask saves that mask for backward in
every layer of every unit (a 8k-token segment at the end of a 32k prefix:
256 MiB per layer). The memory-efficient kernel has the bottom-right causal
mask built in (``custom_mask_type``; torch's own ``CausalBias`` lower-right
dispatch relies on it), so nothing quadratic is built or saved. The kernel
takes equal head counts: grouped K/V heads are expanded inside forward and
backward only, and the un-expanded prefix views are what is saved.
"""

import torch

from torchtitan_seq1f1b.attention.backend import KernelTarget

__all__ = [
    "expand_heads",
    "lower_right_causal_attention_cuda",
    "mem_efficient_backward",
    "mem_efficient_forward",
    "mem_efficient_requirements",
    "sum_groups",
]

# torch.nn.attention.bias.CausalVariant.LOWER_RIGHT, as the kernel numbers it.
_CAUSAL_FROM_BOTTOM_RIGHT = 2


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, L, Hkv, D) -> (B, L, n_heads, D), each K/V head serving its query group."""
    batch, length, n_kv, head_dim = x.shape
    if n_kv == n_heads:
        return x
    group = n_heads // n_kv
    return x[:, :, :, None].expand(batch, length, n_kv, group, head_dim).reshape(
        batch, length, n_heads, head_dim
    )


def sum_groups(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, L, H, D) -> (B, L, n_kv, D): the gradient of :func:`expand_heads`."""
    n_heads = grad.shape[2]
    if n_kv == n_heads:
        return grad
    return grad.unflatten(2, (n_kv, n_heads // n_kv)).sum(3)


# The kernel's logsumexp has rows for Lq rounded up to this; the rest are never read.
_LSE_ROWS_ALIGNMENT = 32


def mem_efficient_forward(q, k, v, scale: float | None, ops=torch.ops.aten):
    """(out, logsumexp): out (B, Lq, H, D), logsumexp (B, H, Lq) float32."""
    n_heads = q.shape[2]
    out, logsumexp, *_ = ops._efficient_attention_forward(
        q,
        expand_heads(k, n_heads),
        expand_heads(v, n_heads),
        None,  # bias
        None,  # cu_seqlens_q
        None,  # cu_seqlens_k
        None,  # max_seqlen_q
        None,  # max_seqlen_k
        0.0,  # dropout_p
        _CAUSAL_FROM_BOTTOM_RIGHT,
        compute_log_sumexp=True,
        scale=scale,
    )
    return out, logsumexp[:, :, : q.shape[1]]


def mem_efficient_backward(grad, q, k, v, out, logsumexp, scale: float | None, ops=torch.ops.aten):
    """(dq, dk, dv) of :func:`mem_efficient_forward`; dk, dv per K/V head."""
    n_heads, n_kv, q_len = q.shape[2], k.shape[2], q.shape[1]
    rows = -(-q_len // _LSE_ROWS_ALIGNMENT) * _LSE_ROWS_ALIGNMENT
    # Without dropout the kernel reads no random state: any seed and offset do.
    no_dropout = torch.zeros((), dtype=torch.int64)
    grad_q, grad_k, grad_v, _ = ops._efficient_attention_backward(
        grad.contiguous(),
        q,
        expand_heads(k, n_heads),
        expand_heads(v, n_heads),
        None,  # bias
        out,
        None,  # cu_seqlens_q
        None,  # cu_seqlens_k
        q_len,
        k.shape[1],
        torch.nn.functional.pad(logsumexp, (0, rows - q_len)),
        0.0,  # dropout_p
        no_dropout,
        no_dropout,
        _CAUSAL_FROM_BOTTOM_RIGHT,
        False,  # bias_requires_grad
        scale=scale,
    )
    return grad_q, sum_groups(grad_k, n_kv), sum_groups(grad_v, n_kv)


class _LowerRightCausalAttentionCUDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, ops):
        out, logsumexp = mem_efficient_forward(q, k, v, scale, ops)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.scale, ctx.ops = scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = mem_efficient_backward(grad_out, *ctx.saved_tensors, ctx.scale, ctx.ops)
        return *grads, None, None


def lower_right_causal_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, ops=torch.ops.aten
) -> torch.Tensor:
    """Causal attention of q_len queries ending a k_len-token prefix, on CUDA.

    q: (batch, q_len, heads, head_dim); k, v: (batch, k_len, kv_heads,
    head_dim), kv_heads dividing heads; the last dim contiguous. Returns
    (batch, q_len, heads, head_dim). ``ops`` lets tests stand in for the
    CUDA-only ops on CPU.
    """
    return _LowerRightCausalAttentionCUDA.apply(q, k, v, scale, ops)


def mem_efficient_requirements(target: KernelTarget) -> list[str]:
    """What torch's CUDA memory-efficient kernel needs (the mask-free exact path)."""
    if target.device.type != "cuda":
        return [f"a CUDA device (this runs on {target.device.type})"]
    unmet = []
    if torch.version.hip is not None:
        # ROCm's backward (AOTriton) takes mask types 0 and 1, not bottom-right (2).
        unmet.append("CUDA, not ROCm (its backward rejects the bottom-right causal mask)")
    capability = target.capability
    if capability < (5, 0):
        unmet.append(f"compute capability >= 5.0 (found {capability[0]}.{capability[1]})")
    if target.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        unmet.append(f"fp16, bf16 or fp32 activations (found {target.dtype})")
    elif target.dtype == torch.bfloat16 and capability < (8, 0):
        unmet.append("compute capability >= 8.0 for bf16")
    alignment = 4 if target.dtype == torch.float32 else 8
    if target.head_dim % alignment:
        unmet.append(f"head_dim a multiple of {alignment} (found {target.head_dim})")
    return unmet

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

__all__ = ["lower_right_causal_attention_cuda", "mem_efficient_requirements"]

# torch.nn.attention.bias.CausalVariant.LOWER_RIGHT, as the kernel numbers it.
_CAUSAL_FROM_BOTTOM_RIGHT = 2


def _expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, L, Hkv, D) -> (B, L, n_heads, D), each K/V head serving its query group."""
    batch, length, n_kv, head_dim = x.shape
    if n_kv == n_heads:
        return x
    group = n_heads // n_kv
    return x[:, :, :, None].expand(batch, length, n_kv, group, head_dim).reshape(
        batch, length, n_heads, head_dim
    )


def _sum_groups(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, L, H, D) -> (B, L, n_kv, D): the gradient of :func:`_expand_heads`."""
    batch, length, n_heads, head_dim = grad.shape
    if n_kv == n_heads:
        return grad
    return grad.view(batch, length, n_kv, n_heads // n_kv, head_dim).sum(3)


class _LowerRightCausalAttentionCUDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, ops):
        n_heads = q.shape[2]
        out, logsumexp, seed, offset, _, _ = ops._efficient_attention_forward(
            q,
            _expand_heads(k, n_heads),
            _expand_heads(v, n_heads),
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
        ctx.save_for_backward(q, k, v, out, logsumexp, seed, offset)
        ctx.scale, ctx.ops = scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, seed, offset = ctx.saved_tensors
        n_heads = q.shape[2]
        grad_q, grad_k, grad_v, _ = ctx.ops._efficient_attention_backward(
            grad_out.contiguous(),
            q,
            _expand_heads(k, n_heads),
            _expand_heads(v, n_heads),
            None,  # bias
            out,
            None,  # cu_seqlens_q
            None,  # cu_seqlens_k
            q.shape[1],
            k.shape[1],
            logsumexp,
            0.0,  # dropout_p
            seed,
            offset,
            _CAUSAL_FROM_BOTTOM_RIGHT,
            False,  # bias_requires_grad
            scale=ctx.scale,
        )
        n_kv = k.shape[2]
        return grad_q, _sum_groups(grad_k, n_kv), _sum_groups(grad_v, n_kv), None, None


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

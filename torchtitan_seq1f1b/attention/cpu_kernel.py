# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch's CPU flash attention kernel with a bottom-right causal or document mask."""

import torch

from torchtitan_seq1f1b.documents import SegmentDocuments

__all__ = ["cpu_flash_backward", "cpu_flash_forward", "lower_right_causal_attention_cpu"]


def additive_mask(
    q_len: int, k_len: int, like: torch.Tensor, documents: SegmentDocuments | None
) -> torch.Tensor:
    """Additive mask: (q_len, k_len) where query t sees keys up to ``k_len - q_len +
    t``, or (batch, 1, q_len, k_len) where it also sees only its own document."""
    if documents is None:
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).tril(k_len - q_len)
    else:
        visible = documents.key_mask()
    return torch.zeros(visible.shape, dtype=like.dtype, device=like.device).masked_fill(
        ~visible, float("-inf")
    )


class _LowerRightCausalAttentionCPU(torch.autograd.Function):
    """torch's CPU flash attention kernel with a mask rebuilt in backward.

    Called with a mask, ``F.scaled_dot_product_attention`` saves it for
    backward as a float (q_len, k_len) tensor: per segment and layer as many
    bytes as the K prefix itself, for a mask that is a pure function of the
    two lengths (and of each query's document start). Here only q, k, v, the
    output and the logsumexp are saved.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, documents):
        out, logsumexp = cpu_flash_forward(q, k, v, scale, documents)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.scale, ctx.documents = scale, documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp = ctx.saved_tensors
        grad_q, grad_k, grad_v = cpu_flash_backward(
            grad_out, q, k, v, out, logsumexp, ctx.scale, ctx.documents
        )
        return grad_q, grad_k, grad_v, None, None


def lower_right_causal_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    documents: SegmentDocuments | None = None,
) -> torch.Tensor:
    """Causal attention of q_len queries ending a k_len-token prefix, on CPU.

    q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, k_len,
    head_dim), kv_heads dividing heads (GQA). Returns (batch, heads, q_len,
    head_dim), equal to SDPA with a lower-right causal mask, restricted to
    each query's document when ``documents`` is given.
    """
    return _LowerRightCausalAttentionCPU.apply(q, k, v, scale, documents)


def cpu_flash_forward(q, k, v, scale, documents):
    """The CPU flash kernel, bottom-right causal (and per document): (out, logsumexp).

    q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, k_len, head_dim).
    """
    if q.shape[2] == k.shape[2] and documents is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
    mask = additive_mask(q.shape[2], k.shape[2], q, documents)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def cpu_flash_backward(grad, q, k, v, out, lse, scale, documents):
    """(dq, dk, dv) of :func:`cpu_flash_forward`, the mask rebuilt; layouts as its."""
    if q.shape[2] == k.shape[2] and documents is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True, scale=scale
        )
    mask = additive_mask(q.shape[2], k.shape[2], q, documents)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )

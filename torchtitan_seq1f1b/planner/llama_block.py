# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A llama-style transformer block, the unit the planner times, and the output head after them.

RMSNorm, GQA attention with RoPE at global positions through
:class:`SegmentAwareAttention`, and a SwiGLU MLP, like torchtitan's llama3
block. The example model stacks it; the planner calibrates on it with a
job's dims, dtype, device and attention backend.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_seq1f1b.attention import SegmentAwareAttention
from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = ["BlockChain", "LlamaBlock", "OutputHead", "summed_cross_entropy"]


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on x: (batch, seq_len, heads, head_dim) at positions: (1 or batch, seq_len)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=x.dtype) / half)
    angles = positions.to(x.dtype)[..., None] * freqs  # (b, seq_len, half)
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Attention(nn.Module):
    def __init__(self, shape: TransformerCost, rope_theta: float, attention_backend: str):
        super().__init__()
        self.head_dim = shape.head_dim
        self.theta = rope_theta
        self.wq = nn.Linear(shape.dim, shape.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.dim, bias=False)
        self.inner_attention = SegmentAwareAttention(attention_backend)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = _rotate(q, positions, self.theta), _rotate(k, positions, self.theta)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaBlock(nn.Module):
    """(batch, seq_len, dim) hidden states at ``positions`` (1 or batch, seq_len) -> same shape.

    Args:
        shape: dims of the model (``dim``, heads, K/V heads, ``ffn_hidden_dim``).
        rope_theta: RoPE base.
        attention_backend: :class:`SegmentAwareAttention`'s backend.
    """

    def __init__(
        self, shape: TransformerCost, rope_theta: float = 10000.0, attention_backend: str = "auto"
    ):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim)
        self.attention = _Attention(shape, rope_theta, attention_backend)
        self.ffn_norm = nn.RMSNorm(shape.dim)
        self.w1 = nn.Linear(shape.dim, shape.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden_dim, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn_hidden_dim, bias=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), positions)
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class BlockChain(nn.Module):
    """``count`` blocks in a row: (batch, seq_len, dim) at positions (1, seq_len) -> same shape."""

    def __init__(self, shape: TransformerCost, count: int, attention_backend: str):
        super().__init__()
        self.blocks = nn.ModuleList(
            LlamaBlock(shape, attention_backend=attention_backend) for _ in range(count)
        )

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, positions)
        return h


class OutputHead(nn.Module):
    """Final norm and LM head: (batch, seq_len, dim) -> (batch, seq_len, vocab_size) logits."""

    def __init__(self, shape: TransformerCost):
        super().__init__()
        self.norm = nn.RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))


def summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over tokens (in fp32): logits (batch, seq_len, vocab_size),
    target (batch, seq_len) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum")

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A segment-aware GatedDeltaNet layer, as torchtitan 0.3's qwen3_5 computes it.

Per token: projections q, k (``n_key_heads * key_head_dim``), v, z
(``n_value_heads * value_head_dim``), a, b (``n_value_heads``), no bias; a
depthwise causal conv of width ``conv_kernel_size`` on q, k and v, then SiLU;
gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``;
the gated delta rule with q, k L2-normalised in it and scale
``key_head_dim ** -0.5``, q/k heads repeated to the value heads; the gated
RMSNorm ``weight * rmsnorm(o) * silu(z)`` per value head; ``out_proj``.

Parameter names follow qwen3_5's ``GatedDeltaNet`` (``norm.weight`` included).
Gates and norms compute in the inputs' dtype promoted with float32 (qwen3_5
casts to float32, which would round float64). Rows are independent
sequences; packed documents (from the running unit, or a one-segment unit
:func:`~torchtitan_seq1f1b.attention.bind_documents` makes) restart the conv
and the state at every document start. Bound to a stage's K/V store
(:func:`~torchtitan_seq1f1b.attention.bind_attention`, as every segment-aware
layer), a segment continues its microbatch's earlier segments through the two
ops of :mod:`.ops`.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_seq1f1b.attention.binding import SegmentAwareLayer
from torchtitan_seq1f1b.linear_attention.backends import RECURRENCE_BACKENDS
from torchtitan_seq1f1b.linear_attention.conv import document_causal_conv
from torchtitan_seq1f1b.linear_attention.ops import conv_tail, recurrence
from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = ["GatedDeltaNetConfig", "GatedRMSNorm", "SegmentAwareGatedDeltaNet"]


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Shapes of a GatedDeltaNet layer (qwen3_5's ``debugmodel``: 256, 2, 4, 64, 64),
    and where its recurrence runs: ``recurrence_backend`` "auto", "fla" or "exact"
    (:mod:`.backends`). With ``merge_single_token_documents`` a one-token packed
    document continues the one before it (torchtitan main's qwen3_5, whose padding
    tokens all sit at position 0)."""

    dim: int
    n_key_heads: int
    n_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    norm_eps: float = 1e-6
    recurrence_backend: str = "auto"
    merge_single_token_documents: bool = False

    def __post_init__(self):
        if self.recurrence_backend not in ("auto", *RECURRENCE_BACKENDS):
            raise ValueError(
                f"recurrence_backend={self.recurrence_backend!r} is unknown; choose one of "
                f"{['auto', *RECURRENCE_BACKENDS]}"
            )
        if self.n_value_heads % self.n_key_heads:
            raise ValueError(
                f"n_value_heads={self.n_value_heads} must be a multiple of n_key_heads={self.n_key_heads}"
            )
        if self.conv_kernel_size < 1:
            raise ValueError(f"conv_kernel_size={self.conv_kernel_size} must be >= 1")

    @property
    def conv_channels(self) -> int:
        """Channels ``C`` of the conv and its tail: q, k and v, ``2 HK K + HV V``."""
        return 2 * self.n_key_heads * self.key_head_dim + self.n_value_heads * self.value_head_dim

    @classmethod
    def like_attention(cls, cost: TransformerCost) -> "GatedDeltaNetConfig":
        """Layers shaped like ``cost``'s attention, as :meth:`TransformerCost.recurrence_flops`
        prices them: a value head per query head, a key head per K/V head, conv width 4."""
        return cls(
            dim=cost.dim,
            n_key_heads=cost.n_kv_heads,
            n_value_heads=cost.n_heads,
            key_head_dim=cost.head_dim,
            value_head_dim=cost.value_head_dim,
        )

    def carry_bytes(self, tail_dtype_bytes: int = 2) -> int:
        """Bytes one row carries across one cut (:mod:`.carry`): the float32 state
        ``(HV, K, V)`` and the conv tail ``(W - 1, C)`` of ``tail_dtype_bytes`` each."""
        state = 4 * self.n_value_heads * self.key_head_dim * self.value_head_dim
        return state + (self.conv_kernel_size - 1) * self.conv_channels * tail_dtype_bytes


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate) over the last dim; x, gate: (..., dim)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        normed = x.to(dtype) * torch.rsqrt(x.to(dtype).square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * normed * F.silu(gate.to(dtype))).to(x.dtype)


class SegmentAwareGatedDeltaNet(SegmentAwareLayer):
    """GatedDeltaNet whose segments of a microbatch continue each other (module doc)."""

    def __init__(self, config: GatedDeltaNetConfig):
        super().__init__()
        self.config = config
        key_dim = config.n_key_heads * config.key_head_dim
        value_dim = config.n_value_heads * config.value_head_dim
        self.in_proj_q = nn.Linear(config.dim, key_dim, bias=False)
        self.in_proj_k = nn.Linear(config.dim, key_dim, bias=False)
        self.in_proj_v = nn.Linear(config.dim, value_dim, bias=False)
        self.in_proj_z = nn.Linear(config.dim, value_dim, bias=False)
        self.in_proj_a = nn.Linear(config.dim, config.n_value_heads, bias=False)
        self.in_proj_b = nn.Linear(config.dim, config.n_value_heads, bias=False)
        width = config.conv_kernel_size
        self.conv_q = nn.Conv1d(key_dim, key_dim, width, groups=key_dim, bias=False)
        self.conv_k = nn.Conv1d(key_dim, key_dim, width, groups=key_dim, bias=False)
        self.conv_v = nn.Conv1d(value_dim, value_dim, width, groups=value_dim, bias=False)
        # A = exp(A_log) in [1, 16] as in fla's GatedDeltaNet; dt_bias 0.
        self.A_log = nn.Parameter(torch.empty(config.n_value_heads).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.zeros(config.n_value_heads))
        self.norm = GatedRMSNorm(config.value_head_dim, config.norm_eps)
        self.out_proj = nn.Linear(value_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, dim), the running segment's tokens (or whole rows). Returns (B, L, dim)."""
        c = self.config
        pre_conv = torch.cat((self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)), dim=-1)
        window, doc_positions = conv_tail(pre_conv, self.handle, c.conv_kernel_size)
        weight = torch.cat((self.conv_q.weight, self.conv_k.weight, self.conv_v.weight))
        mixed = F.silu(document_causal_conv(window, weight, doc_positions))
        key_dim = c.n_key_heads * c.key_head_dim
        q, k, v = mixed.split((key_dim, key_dim, mixed.shape[-1] - 2 * key_dim), dim=-1)
        # Key heads repeated to the value heads as qwen3_5's GatedDeltaKernel does.
        repeat = c.n_value_heads // c.n_key_heads
        q, k = (
            t.unflatten(-1, (c.n_key_heads, c.key_head_dim)).repeat_interleave(repeat, dim=2)
            for t in (q, k)
        )
        v = v.unflatten(-1, (c.n_value_heads, c.value_head_dim))
        dtype = torch.promote_types(x.dtype, torch.float32)
        decay = self.A_log.to(dtype).exp()
        g = -decay * F.softplus(self.in_proj_a(x).to(dtype) + self.dt_bias.to(dtype))
        beta = torch.sigmoid(self.in_proj_b(x))
        o = recurrence(q, k, v, g, beta, doc_positions, self.handle, c.key_head_dim**-0.5)
        o = self.norm(o, self.in_proj_z(x).unflatten(-1, (c.n_value_heads, c.value_head_dim)))
        return self.out_proj(o.flatten(-2))

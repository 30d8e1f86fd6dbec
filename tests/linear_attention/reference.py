# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Plain references, differentiated by autograd: fla's naive recurrent gated delta rule
(with fla's in-kernel L2 norm) and qwen3_5's GatedDeltaNet forward on one document."""

import torch
import torch.nn.functional as F

from torchtitan_seq1f1b.linear_attention import SegmentAwareGatedDeltaNet


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm_fwd: x / sqrt(sum(x^2) + 1e-6) over the last dim."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def naive_delta_rule(q, k, v, g, beta, scale, initial_state=None):
    """One sequence per row, fla's naive_recurrent_gated_delta_rule step for step.

    q, k: (B, T, H, K) before L2 norm; v: (B, T, H, V); g, beta: (B, T, H);
    initial_state: (B, H, K, V) or None. Returns o (B, T, H, V) and the final state.
    """
    q, k = l2norm(q) * scale, l2norm(k)
    batch, length, heads, key_dim = k.shape
    h = k.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(length):
        h = h * g[:, t].exp()[..., None, None]
        b_v = (v[:, t] - (h * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        h = h + k[:, t, ..., None] * b_v[..., None, :]
        outputs.append(torch.einsum("bhd,bhdm->bhm", q[:, t], h))
    return torch.stack(outputs, dim=1), h


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """qwen3_5's fixed-length path: x (B, T, C), weight (C, 1, W) -> (B, T, C)."""
    padded = F.pad(x.transpose(1, 2), [weight.shape[-1] - 1, 0])
    return F.silu(F.conv1d(padded, weight, groups=weight.shape[0])).transpose(1, 2)


def qwen3_5_gdn(layer: SegmentAwareGatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """qwen3_5's GatedDeltaNet forward on x (B, T, dim), each row one document."""
    c = layer.config
    repeat = c.n_value_heads // c.n_key_heads
    q = causal_conv_silu(layer.in_proj_q(x), layer.conv_q.weight)
    k = causal_conv_silu(layer.in_proj_k(x), layer.conv_k.weight)
    v = causal_conv_silu(layer.in_proj_v(x), layer.conv_v.weight)
    q, k = (t.unflatten(-1, (c.n_key_heads, c.key_head_dim)).repeat_interleave(repeat, 2) for t in (q, k))
    v = v.unflatten(-1, (c.n_value_heads, c.value_head_dim))
    g = -layer.A_log.exp() * F.softplus(layer.in_proj_a(x) + layer.dt_bias)
    beta = torch.sigmoid(layer.in_proj_b(x))
    o, _ = naive_delta_rule(q, k, v, g, beta, c.key_head_dim**-0.5)
    z = layer.in_proj_z(x).unflatten(-1, (c.n_value_heads, c.value_head_dim))
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + c.norm_eps)
    return layer.out_proj((layer.norm.weight * o * F.silu(z)).flatten(-2))

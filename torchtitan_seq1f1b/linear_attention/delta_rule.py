# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The gated delta rule in plain torch, exact in the inputs' dtype, with its backward.

It computes what fla's ``chunk_gated_delta_rule(q, k, v, g, beta, scale,
initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)``
computes, token by token instead of chunk by chunk. Per row and value head,
with ``q``, ``k`` L2-normalised (``x / sqrt(sum(x^2) + 1e-6)``) and the state
``S`` a (K, V) matrix starting at ``initial_state``::

    S = exp(g_t) * S                       # decay
    u = v_t - S^T k_t                      # what S predicts wrong for k_t
    S = S + k_t (beta_t * u)^T             # delta-rule write
    o_t = scale * S^T q_t

A token that starts a document (``resets``) first sets ``S`` to zero, so
packed documents never see each other's state; one that starts a row's first
document ignores ``initial_state``. fla keeps ``S`` in float32; here it keeps
the inputs' dtype, so float64 is exact.

The backward walks the tokens in reverse from ``grad_final_state`` (fla's
``dht``) and returns the initial state's gradient (fla's ``dh0``), so a
later segment's gradient can flow into an earlier one's final state.
"""

import functools
from dataclasses import dataclass

import torch

__all__ = ["DeltaRuleGrads", "delta_rule_backward", "delta_rule_forward", "gated_delta_rule"]

L2NORM_EPS = 1e-6  # fla's l2norm_fwd default, which use_qk_l2norm_in_kernel uses


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (x * rstd, rstd (..., 1)) with rstd = 1 / sqrt(sum(x^2) + eps)."""
    rstd = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rstd, rstd


def _l2norm_backward(normed: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of x from that of ``normed = x * rstd``: rstd * (grad - (grad . normed) normed)."""
    return rstd * (grad - (grad * normed).sum(-1, keepdim=True) * normed)


def _common_dtype(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors in their promoted dtype: fp32 gates (as GDN computes them) lift bf16 q/k/v."""
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in tensors if x is not None))
    return [None if x is None else x.to(dtype) for x in tensors]


def _states(q, k, v, g, beta, initial_state, resets):
    """Every state the forward passes through: a list of L + 1 (B, H, K, V) tensors,
    the initial one (zeros if None) first, then the one after each token."""
    batch, length, heads, key_dim = k.shape
    state = initial_state
    if state is None:
        state = k.new_zeros(batch, heads, key_dim, v.shape[-1])
    states = [state]
    for t in range(length):
        if resets is not None:
            # where, not a product: a reset drops the state whatever it holds.
            state = torch.where(resets[:, t, None, None, None], 0, state)
        state = state * g[:, t, :, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        written = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * written[:, :, None, :]
        states.append(state)
    return states


def delta_rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a (segment of a) sequence.

    Args:
        q, k: (B, L, H, K), not yet L2-normalised; heads already repeated to
            the value heads.
        v: (B, L, H, V).
        g: (B, L, H) log decay (<= 0 in GDN).
        beta: (B, L, H) write strength.
        scale: multiplies every output (fla's default is K ** -0.5).
        initial_state: (B, H, K, V), or None for zeros.
        resets: (B, L) bool, True where a token starts a document; None: none do.

    Returns:
        o: (B, L, H, V) in v's dtype, and the final state (B, H, K, V) in the
        inputs' promoted dtype (float32 for bf16 q/k/v with float32 gates).
    """
    out_dtype = v.dtype
    q, k, v, g, beta, initial_state = _common_dtype(q, k, v, g, beta, initial_state)
    q, _ = _l2norm(q)
    k, _ = _l2norm(k)
    states = _states(q, k, v, g, beta, initial_state, resets)
    o = torch.einsum("lbhkv,blhk->blhv", torch.stack(states[1:]), q) * scale
    return o.to(out_dtype), states[-1]


@dataclass(frozen=True)
class DeltaRuleGrads:
    """Gradients of :func:`delta_rule_forward`'s inputs, in their shapes; a backend
    given no initial state may leave its gradient None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None


def delta_rule_backward(
    grad_o: torch.Tensor,
    grad_final_state: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> DeltaRuleGrads:
    """Gradients of :func:`delta_rule_forward` (same arguments), given grad_o
    (B, L, H, V) and the final state's gradient (B, H, K, V) or None for zeros.

    The states are recomputed (L + 1 of them), then walked back token by token.
    """
    inputs = q, k, v, g, beta
    q, k, v, g, beta, initial_state, grad_o, grad_final_state = _common_dtype(
        q, k, v, g, beta, initial_state, grad_o, grad_final_state
    )
    q_normed, q_rstd = _l2norm(q)
    k_normed, k_rstd = _l2norm(k)
    states = _states(q_normed, k_normed, v, g, beta, initial_state, resets)
    grad_state = torch.zeros_like(states[0]) if grad_final_state is None else grad_final_state
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grad_g, grad_beta = torch.empty_like(g), torch.empty_like(beta)
    for t in reversed(range(q.shape[1])):
        k_t, do_t = k_normed[:, t], grad_o[:, t]
        kept = states[t]
        if resets is not None:
            kept = torch.where(resets[:, t, None, None, None], 0, kept)
        decayed = kept * g[:, t, :, None, None].exp()
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", decayed, k_t)
        # o_t = scale * S_t^T q_t
        grad_q[:, t] = scale * torch.einsum("bhkv,bhv->bhk", states[t + 1], do_t)
        grad_state = grad_state + scale * q_normed[:, t, :, :, None] * do_t[:, :, None, :]
        # S_t = decayed + k_t (beta_t * error)^T
        grad_written = torch.einsum("bhkv,bhk->bhv", grad_state, k_t)
        grad_error = beta[:, t, :, None] * grad_written
        grad_beta[:, t] = (grad_written * error).sum(-1)
        grad_v[:, t] = grad_error
        grad_k[:, t] = torch.einsum(
            "bhkv,bhv->bhk", grad_state, beta[:, t, :, None] * error
        ) - torch.einsum("bhkv,bhv->bhk", decayed, grad_error)
        # error = v_t - decayed^T k_t, and decayed = exp(g_t) * kept
        grad_decayed = grad_state - k_t[:, :, :, None] * grad_error[:, :, None, :]
        grad_g[:, t] = (grad_decayed * decayed).sum((-2, -1))
        grad_state = grad_decayed * g[:, t, :, None, None].exp()
        if resets is not None:
            grad_state = torch.where(resets[:, t, None, None, None], 0, grad_state)
    grads = (
        _l2norm_backward(q_normed, q_rstd, grad_q),
        _l2norm_backward(k_normed, k_rstd, grad_k),
        grad_v,
        grad_g,
        grad_beta,
    )
    # Each input's gradient in its dtype; the initial state's in the compute dtype, as fla's dh0.
    q, k, v, g, beta = (grad.to(x.dtype) for grad, x in zip(grads, inputs))
    return DeltaRuleGrads(q=q, k=k, v=v, g=g, beta=beta, initial_state=grad_state)


class _GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, resets, scale):
        ctx.save_for_backward(q, k, v, g, beta, initial_state, resets)
        ctx.scale = scale
        return delta_rule_forward(q, k, v, g, beta, scale, initial_state, resets)

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, beta, initial_state, resets = ctx.saved_tensors
        grads = delta_rule_backward(
            grad_o, grad_final_state, q, k, v, g, beta, ctx.scale, initial_state, resets
        )
        grad_initial = None if initial_state is None else grads.initial_state.to(initial_state.dtype)
        return grads.q, grads.k, grads.v, grads.g, grads.beta, grad_initial, None, None


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_rule_forward` under autograd (shapes there); ``scale`` None is K ** -0.5.

    Returns (o, final_state); both are differentiable, as are all tensor inputs but ``resets``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _GatedDeltaRule.apply(q, k, v, g, beta, initial_state, resets, scale)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""fla's chunked gated delta rule, forward and backward as two calls: the one place
that reaches into fla's private functions.

The forward is fla's public ``chunk_gated_delta_rule``. Its backward is an
autograd Function's, which cannot run inside a registered op's backward
(autograd is off there), so :func:`chunk_gated_delta_rule_backward` calls the
functions that Function calls (fla 0.6: ``l2norm_fwd``/``l2norm_bwd``,
``chunk_gated_delta_rule_fwd``/``_bwd``, ``prepare_chunk_indices``), which fla
may change in any release: :data:`TESTED` pins the versions read, and
:func:`unmet` refuses others.
"""

import importlib
import importlib.metadata

import torch

__all__ = [
    "CHUNK_SIZE",
    "TESTED",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_backward",
    "chunk_indices",
    "unmet",
]

TESTED = ((0, 6, 0), (0, 6, 1))  # [first, last) fla-core versions whose privates were read
CHUNK_SIZE = 64  # fla's default chunk, which chunk_indices are counted in


def _version() -> tuple[int, ...] | None:
    """The installed fla-core's (major, minor, patch), None if not installed."""
    try:
        release = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in release.split(".")[:3] if part.isdigit())


def unmet() -> list[str]:
    """Why fla's kernels cannot be called here (empty if they can): not installed,
    or a version whose private functions were not checked."""
    first, last = TESTED
    wanted = f"fla-core >= {'.'.join(map(str, first))}, < {'.'.join(map(str, last))}"
    version = _version()
    if version is None:
        return [f"{wanted} installed (pip install fla-core)"]
    if not first <= version < last:
        found = ".".join(map(str, version))
        return [f"{wanted} (found {found}: its private backward functions are untested here)"]
    return []


def _private(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def chunk_gated_delta_rule(*args, **kwargs):
    """fla's public ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, imported when called."""
    public = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    return public(*args, **kwargs)


def chunk_indices(cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
    """(chunks, 2) int64 on the host: fla's (sequence, chunk) index of every
    ``CHUNK_SIZE`` chunk of the sequences of (N + 1,) ``cu_seqlens_cpu``."""
    prepare = _private("fla.ops.utils.index", "prepare_chunk_indices")
    return prepare(cu_seqlens_cpu, CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_gated_delta_rule_backward(
    do: torch.Tensor,
    dht: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
    output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=...,
    chunk_indices=...)`` given do (B, T, HV, V) and dht (N, HV, K, V) or None.

    Returns (dq, dk, dv, dg, dbeta) in their inputs' dtypes and dh0 (N, HV, K, V)
    float32, None without an initial state. The forward's chunk intermediates
    are recomputed first: a registered op keeps nothing between its calls.
    """
    l2norm_fwd = _private("fla.modules.norm.l2norm", "l2norm_fwd")
    l2norm_bwd = _private("fla.modules.norm.l2norm", "l2norm_bwd")
    chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    q_normed, q_rstd = l2norm_fwd(q)
    k_normed, k_rstd = l2norm_fwd(k)
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE)
    g_cumsum, _, A, _, _, _ = chunk.chunk_gated_delta_rule_fwd(
        q=q_normed, k=k_normed, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=False, **varlen,
    )
    dq, dk, dv, dbeta, dg, dh0, _, _ = chunk.chunk_gated_delta_rule_bwd(
        q=q_normed, k=k_normed, v=v, g=g_cumsum, beta=beta, A=A, scale=scale,
        initial_state=initial_state, do=do, dht=dht, **varlen,
    )
    dq, dk = l2norm_bwd(q_normed, q_rstd, dq), l2norm_bwd(k_normed, k_rstd, dk)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0

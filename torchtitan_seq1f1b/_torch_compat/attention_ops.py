# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The backward of torch's varlen attention, which torch only calls from autograd.

``torch.nn.attention.varlen.varlen_attn`` is public; its backward is the
private op ``torch_attn::_varlen_attn_backward`` (same leading arguments on
every tested torch). The registered segment attention op runs below
autograd and calls it itself.
"""

import torch
import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn ops

__all__ = ["varlen_attn_backward"]


def varlen_attn_backward(
    grad, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale, window=(-1, 0)
):
    """(dq, dk, dv) of ``varlen_attn(..., window_size=window)`` on packed (tokens, heads,
    head_dim) inputs; lse (heads, tokens_q) as the forward returned it."""
    # torch's forward returns this fixed state: it runs without dropout.
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    return torch.ops.torch_attn._varlen_attn_backward(
        grad, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, True, rng_state,
        scale=scale, window_size=list(window),
    )

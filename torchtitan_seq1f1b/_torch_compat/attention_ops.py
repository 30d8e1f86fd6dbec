# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch's attention ops below the public API, and what each torch's support for them is.

``torch.nn.attention.varlen.varlen_attn`` is public; its backward is the
private op ``torch_attn::_varlen_attn_backward`` (same leading arguments on
every tested torch). The registered segment attention op runs below
autograd and calls it itself.
"""

import torch
import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn ops

from torchtitan_seq1f1b._torch_compat import TORCH_RELEASE

__all__ = ["FLASH_IMPLS_RUN_VARLEN", "varlen_attn_backward"]

# torch 2.11's FlashAttention-4/-3 overrides of its flash ops refuse every varlen
# call: they take varlen_attn's causal window (-1, 0) for a sliding window.
FLASH_IMPLS_RUN_VARLEN = TORCH_RELEASE >= (2, 12)


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

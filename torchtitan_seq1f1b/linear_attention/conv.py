# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""GatedDeltaNet's short causal convolution, within documents, over a segment and its tail.

qwen3_5 convolves q, k and v (before SiLU) depthwise with a kernel of width
W (4), left-padded with zeros, and restarts at every document start. Here
the input is a *window*: the segment's ``L`` tokens after the ``W - 1``
tokens before it (the conv tail; zeros before the sequence's start), so the
conv needs no padding and a segment's first outputs read the previous
segment's inputs. Tap ``i`` of output ``t`` reads input ``t - (W - 1) + i``;
it is dropped when that input lies before ``t``'s document start, which
covers a document starting inside the segment and tail entries of another
document alike. The weight's gradient stays in autograd.
"""

import torch

__all__ = ["document_causal_conv"]


def document_causal_conv(
    window: torch.Tensor, weight: torch.Tensor, doc_positions: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal conv of a segment, no bias, no activation.

    Args:
        window: (B, W - 1 + L, C): the conv tail, then the segment's inputs.
        weight: (C, 1, W) or (C, W): each channel's kernel (nn.Conv1d's layout), oldest tap first.
        doc_positions: (B, L) int: each token's index within its document (0 at a start).

    Returns:
        (B, L, C), what ``F.conv1d(pad(x), weight, groups=C)`` gives with zeros
        wherever a tap reaches before the token's document.
    """
    weight = weight.reshape(weight.shape[0], -1)
    width = weight.shape[-1]
    taps = window.unfold(1, width, 1)  # (B, L, C, W): taps[b, t, c, i] = window[b, t + i, c]
    # Tap i reaches W - 1 - i tokens back: inside the document iff that many precede t in it.
    reach = torch.arange(width - 1, -1, -1, device=window.device)
    inside = (reach <= doc_positions[..., None]).to(window.dtype)  # (B, L, W)
    return torch.einsum("blci,bli,ci->blc", taps, inside, weight)

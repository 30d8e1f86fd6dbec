# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One microbatch's image features on the first stage, from segment 0's forward to its
last backward.

Segment 0's forward encodes the microbatch's images once; every segment scatters
the rows of its own image tokens from the same detached features, and every
segment's backward adds its rows' gradient to one bank. Segments of a
microbatch run backward last to first, so segment 0's backward is the last: it
backpropagates the encoder once, with the gradient summed over every segment.
"""

import torch

__all__ = ["ImageFeatures", "image_feature_index"]


def image_feature_index(is_image: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: each image token's row in the microbatch's features, -1 for text.

    is_image: (B, T) bool over whole sequences (``tokens == image_token_id``).
    Rows count image tokens row-major over the microbatch, the order in which
    torchtitan's VLMs scatter their items' features. Computed before the step,
    on whole sequences, so the schedule cuts it with the segments.
    """
    flat = is_image.flatten()
    index = flat.long().cumsum(0) - 1
    return index.masked_fill(~flat, -1).view_as(is_image)


class ImageFeatures:
    """A microbatch's encoded images: ``features`` (N, dim), one row per image token,
    a leaf detached from ``encoded`` (the encoder's output, with its graph), and
    the bank of their gradient (fp32 or wider) that segments' backwards fill."""

    def __init__(self, encoded: torch.Tensor, num_segments: int):
        self.encoded: torch.Tensor | None = encoded
        self.features = encoded.detach().requires_grad_(encoded.requires_grad)
        self.grad: torch.Tensor | None = None
        self.next_backward = num_segments - 1  # segments run backward last to first

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + (0 if self.grad is None else self.grad.nbytes)

    def bank_grad(self, segment: int, index: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a segment's rows' gradient to the bank.

        index: (B, L) the segment's :func:`image_feature_index`, -1 for text;
        grad: (B, L, dim) the gradient at its positions, zero at text tokens.
        """
        if segment != self.next_backward:
            raise RuntimeError(
                f"segment {segment}'s image features backward ran when segment "
                f"{self.next_backward}'s was due: segments of a microbatch must run "
                "backward last to first, each once"
            )
        self.next_backward -= 1
        if self.grad is None:
            # bf16/fp16 gradients are summed over up to k segments: keep fp32.
            dtype = torch.promote_types(self.features.dtype, torch.float32)
            self.grad = torch.zeros(self.features.shape, dtype=dtype, device=grad.device)
        # Text positions add their zero gradient to row 0: exact, and no host sync.
        rows = grad.flatten(0, -2).to(self.grad.dtype)
        self.grad.index_add_(0, index.clamp(min=0).flatten(), rows)

    def backward_encoder(self) -> None:
        """Backpropagate the encoder once with the bank, after segment 0's rows (the
        microbatch's last backward) were banked."""
        if self.next_backward != -1:
            raise RuntimeError(
                f"the encoder's backward is due after segment 0's, but segment "
                f"{self.next_backward}'s has not run"
            )
        encoded, grad = self.encoded, self.grad
        # The encoder's graph and the bank go with its one backward.
        self.encoded = self.grad = None
        if encoded.requires_grad:
            torch.autograd.backward(encoded, grad.to(encoded.dtype))

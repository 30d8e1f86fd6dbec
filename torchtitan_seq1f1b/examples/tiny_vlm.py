# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A tiny vision-language model: the tiny transformer with a patch encoder on its first stage.

Shaped like torchtitan's qwen3_5 where Seq1F1B touches it: the first stage embeds the
tokens, encodes the images (one token per patch: a linear layer and GELU over each
flattened patch) and writes the features at the image tokens
(:class:`~torchtitan_seq1f1b.vision.SegmentAwareImageScatter`); every stage takes
mrope-style positions (batch, seq_len, 3), temporal, height and width, which the
blocks' RoPE rotates by, summed. Under ``activation_checkpoint="full"`` the embedding
and image scatter are checkpointed too, so a recompute passes through the scatter.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformer, TinyTransformerArgs
from torchtitan_seq1f1b.vision import SegmentAwareImageScatter

__all__ = ["PatchEncoder", "TinyVLM", "TinyVLMArgs"]


@dataclass(frozen=True)
class TinyVLMArgs(TinyTransformerArgs):
    image_token_id: int = 63
    """The placeholder token of image tokens, one per patch."""
    patch_dim: int = 12
    """Values per flattened patch."""


class PatchEncoder(nn.Module):
    """pixel_values (num_images, patches, patch_dim) -> features (num_images, patches, dim)."""

    def __init__(self, patch_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(patch_dim, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(pixel_values))


class TinyVLM(TinyTransformer):
    """tokens (batch, seq_len) and images -> logits (batch, seq_len, vocab_size); stages
    as :class:`TinyTransformer`'s, the encoder on the first with the embedding."""

    def __init__(self, args: TinyVLMArgs):
        super().__init__(args)
        self.vision_encoder: PatchEncoder | None = PatchEncoder(args.patch_dim, args.dim)
        self.image_scatter: SegmentAwareImageScatter | None = SegmentAwareImageScatter()

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: tokens (batch, L) on the first stage, else hidden states (batch, L, dim);
        positions: (batch, L, 3), None for 0..L-1; pixel_values: (num_images, patches,
        patch_dim); image_index: (batch, L) each image token's feature row, -1 for text
        (:func:`~torchtitan_seq1f1b.vision.image_feature_index`)."""
        if self.tok_embeddings is not None:
            if self.args.activation_checkpoint == "full" and torch.is_grad_enabled():
                x = checkpoint(self._embed, x, pixel_values, image_index, use_reentrant=False)
            else:
                x = self._embed(x, pixel_values, image_index)
        return self.decode(x, None if positions is None else positions.sum(-1))

    def _embed(self, tokens, pixel_values, image_index) -> torch.Tensor:
        encode = None if pixel_values is None else lambda: self.vision_encoder(pixel_values)
        return self.image_scatter(self.tok_embeddings(tokens), encode, image_index)

    def stage(
        self, stage_index: int, num_stages: int, compile_blocks: bool | None = None
    ) -> "TinyVLM":
        part = super().stage(stage_index, num_stages, compile_blocks)
        if stage_index > 0:
            part.vision_encoder = part.image_scatter = None
        return part

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A vision-language model's "encode images, scatter into the embeddings", segment-aware.

torchtitan's VLMs (qwen3_5, kimi_k2_5) run a vision encoder on the first stage:
``pixel_values`` -> one feature row per image token, written into the token
embeddings at the image tokens' positions before the decoder layers. Under
Seq1F1B a segment holds only some image tokens, and an image's tokens may
straddle a cut. :class:`SegmentAwareImageScatter` encodes a microbatch's images
once, in segment 0's forward, and keeps the features in the stage's K/V store
(:class:`~torchtitan_seq1f1b.vision.features.ImageFeatures`, freed with the
microbatch); each segment scatters the rows of its own image tokens, found
through an index map cut with the segment
(:func:`~torchtitan_seq1f1b.vision.features.image_feature_index`); segment 0's
backward, the microbatch's last, runs the encoder's backward once with the
features' gradient summed over the segments.

The first stage's backward is its whole backward (torch runs it in the weight
step under split backwards), so the encoder's weights get their gradients in
segment 0's W step there, as every first-stage weight does. A checkpoint
recompute finds the features kept and encodes nothing; the scatter's backward
runs once per segment whichever forward saved it.
"""

from collections.abc import Callable

import torch

from torchtitan_seq1f1b.attention.binding import SegmentAwareLayer
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.vision.features import ImageFeatures

__all__ = ["SegmentAwareImageScatter"]


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _scatter(embeds: torch.Tensor, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """embeds (B, L, dim) with row ``index[b, t]`` of features (N, dim) where it is >= 0."""
    rows = features.index_select(0, index.clamp(min=0).flatten()).view(*index.shape, -1)
    return torch.where((index >= 0)[..., None], rows.to(embeds.dtype), embeds)


class _ScatterFeatures(torch.autograd.Function):
    """embeds with the image tokens' feature rows written in; the rows' gradient goes to
    the microbatch's bank instead of to ``features``."""

    @staticmethod
    def forward(ctx, embeds, features, index, state: ImageFeatures, segment: int, store: KVStore):
        ctx.save_for_backward(index)
        ctx.state, ctx.segment, ctx.store = state, segment, store
        return _scatter(embeds, features, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        is_image = (index >= 0)[..., None]
        ctx.state.bank_grad(ctx.segment, index, grad.masked_fill(~is_image, 0))
        ctx.store.record_peak()  # the bank appears during backward
        if ctx.segment == 0:
            ctx.state.backward_encoder()
        return grad.masked_fill(is_image, 0), None, None, None, None, None


class SegmentAwareImageScatter(SegmentAwareLayer):
    """A microbatch's image features written into its token embeddings.

    It owns no parameters: the model keeps its encoder where its checkpoints
    name it and hands the scatter ``encode``, a call that runs the encoder on
    the microbatch's images. Bound to a stage's K/V store
    (:func:`~torchtitan_seq1f1b.attention.bind_attention`), a unit's segment 0
    encodes and the others reuse its features (module doc); unbound or outside
    a unit, whole rows are encoded and scattered in plain autograd.
    """

    def forward(
        self,
        embeds: torch.Tensor,
        encode: Callable[[], torch.Tensor] | None,
        image_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """embeds: (B, L, dim) the segment's token embeddings; encode: () -> the
        microbatch's features, rows in :func:`image_feature_index` order once
        flattened over all but the last dim, (N, dim) or (num_images,
        tokens_per_image, dim) (None: no images); image_index: (B, L) int64 the
        segment's cut of :func:`image_feature_index`. Returns (B, L, dim)."""
        if encode is None:
            return embeds
        store = self.kv_store
        running = None if store is None else store.running
        if running is None:
            features = encode().flatten(0, -2)
            return _scatter(embeds, features, image_index) if features.shape[0] else embeds
        if running.context is not None:
            raise NotImplementedError("image features do not run under context parallelism")
        state = store.layer_state(self, lambda: self._encode(encode, running), embeds)
        store.record_peak()
        if state.features.shape[0] == 0:
            return embeds
        return _ScatterFeatures.apply(
            embeds, state.features, image_index, state, running.unit.segment, store
        )

    def _encode(self, encode: Callable[[], torch.Tensor], running) -> ImageFeatures:
        # The encoder's graph outlives this segment's checkpoint region, if any: its
        # saved tensors must not go through that region's hooks.
        with torch.autograd.graph.saved_tensors_hooks(_unchanged, _unchanged):
            encoded = encode().flatten(0, -2)
        return ImageFeatures(encoded, running.plan.num_segments)

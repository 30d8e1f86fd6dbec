# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan 0.3 decoder's attention made segment-aware, with its document masks.

torchtitan 0.3's language models are always document-masked: the dataloader
emits per-document ``positions`` (0 at every document start), the trainer asks
the first model part for ``get_attention_masks(positions=...)`` (a flex
BlockMask or varlen metadata) and hands the result, with the positions, to
the model or to every pipeline stage. Neither kernel can attend a segment to
its microbatch's earlier segments, and neither trains on CPU. So a model is
converted (:func:`make_segment_aware`):

- every ``<attention>.inner_attention`` becomes :class:`SegmentAwareInnerAttention`,
  which takes torchtitan 0.3's inner-attention call: q, k, v of shape
  (batch, seq, heads, head_dim) and keyword ``attention_masks=``, ``scale=``
  and gpt_oss's attention-sink ``out_transform=``, keeping a block's sliding
  window (:func:`window_left`); a block without softmax attention is refused,
  naming its layer type (:func:`unconvertible_layers`);
- ``get_attention_masks`` returns document ids (batch, seq) instead
  (:func:`positions_document_ids`, the ids torchtitan's
  ``get_document_mask_mod`` derives);
- a Seq1F1B schedule takes them as its ``document_ids_kwarg``, so the model
  never sees them; an unpipelined model, or a part under one of torch's
  schedules, gets a forward pre-hook that binds them
  (:func:`parallelize_with_document_ids`, on CPU, where torchtitan's own
  kernels cannot train).

RoPE positions stay torchtitan's per-document positions; a Seq1F1B schedule
cuts them with the segments.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan_seq1f1b.attention import SegmentAwareAttention, SegmentAwareLayer, wrap_attention
from torchtitan_seq1f1b.integration.document_masks import (
    bind_masks_as_documents,
    is_inner_attention,
    MASKS_KWARG,
)
from torchtitan_seq1f1b.integration.segment_plan import Seq1F1BConfigError
from torchtitan_seq1f1b.integration.titan_0_3.gated_delta_net import (
    convert_gated_delta_nets,
    is_gated_delta_net,
)
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

__all__ = [
    "MASKS_KWARG",
    "SegmentAwareInnerAttention",
    "attention_sinks",
    "make_segment_aware",
    "parallelize_with_document_ids",
    "positions_document_ids",
    "unconvertible_layers",
    "window_left",
]


class SegmentAwareInnerAttention(SegmentAwareAttention):
    """:class:`SegmentAwareAttention` called as torchtitan 0.3 calls inner attention."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Callable | None = None,
    ) -> torch.Tensor:
        """
        Args:
            q: (batch, seq_len, n_heads, head_dim), RoPE applied; on torchtitan
                main (:data:`~.release.FOLDED`) one packed row, (seq_len, n_heads,
                head_dim), and so are k, v and the result.
            k: (batch, seq_len, n_kv_heads, head_dim).
            v: (batch, seq_len, n_kv_heads, v_head_dim); MLA's differs from head_dim.
            attention_masks: must be None: document ids reach the layer
                through the schedule or :func:`bind_documents`, never as masks.
            scale: softmax scale; ``None`` means 1/sqrt(head_dim).
            enable_gqa: accepted for drop-in compatibility; GQA follows from
                the head counts.
            out_transform: None, or gpt_oss's attention-sink rescale
                (``_apply_sinks``: ``out * sigmoid(lse - sinks)``), which runs
                inside the attention (:func:`attention_sinks`).

        Returns:
            (batch, seq_len, n_heads, v_head_dim)
        """
        if attention_masks is not None:
            raise ValueError(
                "segment-aware attention got attention_masks; its model's document "
                "ids must go to a Seq1F1B schedule's document_ids_kwarg or to "
                "bind_documents, not to the layers"
            )
        sinks = None if out_transform is None else attention_sinks(out_transform)
        if FOLDED:
            return self.attend(q[None], k[None], v[None], scale, sinks)[0]
        return self.attend(q, k, v, scale, sinks)


def attention_sinks(out_transform: Callable) -> torch.Tensor:
    """The (n_heads,) sink logits of torchtitan's sink rescale, an attention's
    ``_apply_sinks`` (gpt_oss); raises ValueError for any other ``out_transform``,
    which needs a logsumexp the segment-aware attention does not return."""
    owner = getattr(out_transform, "__self__", None)
    sinks = getattr(owner, "sinks", None)
    if getattr(out_transform, "__name__", None) != "_apply_sinks" or not isinstance(
        sinks, torch.Tensor
    ):
        raise ValueError(
            f"segment-aware attention runs torchtitan's attention-sink rescale "
            f"(_apply_sinks) as its out_transform, not {out_transform!r}"
        )
    if isinstance(sinks, DTensor):
        sinks = sinks.to_local(grad_placements=sinks.placements)
    return sinks


def positions_document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document ids as torchtitan 0.3's ``get_document_mask_mod`` derives them.

    positions: (batch, seq_len) per-document positions, 0 at each document start,
    or torchtitan main's packed row, (seq_len,)
    -> (batch, seq_len) int64, non-decreasing: the number of document starts
    at or before each position, minus one; main's row is a batch of one.
    """
    ids = torch.cumsum(positions == 0, dim=-1) - 1
    return ids.view(-1, positions.shape[-1])


def unconvertible_layers(model: nn.Module) -> list[str]:
    """Why each transformer block of a torchtitan 0.3 decoder (or part) cannot be
    made segment-aware, one line per block, naming its token mixer; empty if all can."""
    problems = []
    for name, block in getattr(model, "layers", {}).items():
        mixer = _mixer(block)
        if getattr(mixer, "inner_attention", None) is None and not is_gated_delta_net(mixer):
            where = f"layers.{name} ({type(mixer if mixer is not None else block).__name__})"
            problems.append(
                f"{where}: neither softmax attention nor qwen3_5's GatedDeltaNet, the "
                "token mixers Seq1F1B makes segment-aware"
            )
    return problems


def _mixer(block: nn.Module) -> nn.Module | None:
    return getattr(block, "attention", None) or getattr(block, "attn", None)


def window_left(model: nn.Module, block: nn.Module) -> int | None:
    """How many keys before each query a block's sliding-window attention sees; None
    without a window (or without softmax attention). varlen attention holds it
    (``window_size[0]``); flex blocks name the model's one sliding-window mask,
    built from the first window in the model's config (gpt_oss's
    ``get_attention_masks``)."""
    inner = getattr(_mixer(block), "inner_attention", None)
    if inner is None:
        return None
    left, _ = getattr(inner, "window_size", (-1, 0))
    if left >= 0:
        return left
    if getattr(block, "attn_mask_key", None) == "sliding_window_mask":
        sizes = (getattr(layer.attention, "sliding_window_size", None) for layer in model.config.layers)
        return next(size for size in sizes if size is not None) - 1
    return None


def make_segment_aware(model: nn.Module, backend: str) -> int:
    """Convert a torchtitan 0.3 decoder (or a pipeline part of one) in place.

    Call before torchtitan's ``parallelize_fn`` (AC and FSDP wrap the new
    modules). Returns the number of layers converted, softmax and linear
    attention. Raises :class:`Seq1F1BConfigError` naming every block that
    cannot be converted.
    """
    problems = unconvertible_layers(model)
    if problems:
        raise Seq1F1BConfigError(
            "Seq1F1B cannot make these layers segment-aware:\n  - " + "\n  - ".join(problems)
        )
    windows = {name: window_left(model, block) for name, block in model.layers.items()}
    converted = wrap_attention(model, is_inner_attention, backend, SegmentAwareInnerAttention)
    for name, block in model.layers.items():
        inner = getattr(_mixer(block), "inner_attention", None)
        if inner is not None:
            inner.window_left = windows[name]
    converted += convert_gated_delta_nets(model)
    model.get_attention_masks = positions_document_ids
    return converted


def parallelize_with_document_ids(parallelize_fn, backend: str):
    """``parallelize_fn`` that first converts a model or pipeline part not yet converted.

    For a machine without an accelerator, where torchtitan's flex and varlen
    attention cannot train: an unpipelined model, or a part pipelined by one
    of torch's schedules (``seq1f1b.schedule = "none"``), then computes the
    same document-masked attention as Seq1F1B's stages, with the document ids
    bound before each forward. (A forward binds its own microbatch's ids, so
    under torch's schedules activation-checkpoint recompute would see the
    latest forward's: :func:`~.config_checks.check_config` refuses that.)
    Seq1F1B's parts pass through: the pipelining function converted them.
    """

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs) -> nn.Module:
        # A part may hold GatedDeltaNet layers alone: any segment-aware layer counts.
        if any(isinstance(m, SegmentAwareLayer) for m in model.modules()):
            return parallelize_fn(model, **kwargs)
        make_segment_aware(model, backend)
        model = parallelize_fn(model, **kwargs)
        model.register_forward_pre_hook(bind_masks_as_documents, with_kwargs=True)
        return model

    return parallelize

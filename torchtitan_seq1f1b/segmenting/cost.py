# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a segment costs: the FLOP model segment plans are balanced with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["SegmentCost", "TransformerCost", "check_span", "is_int"]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_span(length: int, end: int, seq_len: int | None = None) -> None:
    """Raise unless ``[end - length, end)`` is a non-empty span (within ``[0, seq_len)``)."""
    if not (is_int(length) and is_int(end) and 0 < length <= end):
        raise ValueError(f"need ints 0 < length <= end, got length={length!r}, end={end!r}")
    if seq_len is not None and end > seq_len:
        raise ValueError(f"end={end} is past this cost's seq_len={seq_len}")


class SegmentCost(Protocol):
    """What :meth:`SegmentPlan.balanced` needs: the forward FLOPs of a segment.

    The cost must be a sum over the segment's query positions of a positive
    per-position cost that does not depend on where segments are cut (true of
    causal and of document-masked attention): then FLOPs add up over any split,
    and a longer segment ending at the same position costs more.
    """

    def forward_flops(self, length: int, end: int) -> int:
        """FLOPs of the forward pass over tokens ``[end - length, end)``."""


@dataclass(frozen=True)
class TransformerCost:
    """A decoder-only transformer's shape, and its forward FLOPs per segment.

    The segment planner reads the FLOPs; the simulator also counts parameters
    and activations from the same shape (:mod:`torchtitan_seq1f1b.tools.model_shapes`).

    Args:
        n_layers: number of transformer blocks ``L``.
        dim: model width ``H``.
        n_heads: query heads ``h``; the head dim is ``d = H // h``.
        n_kv_heads: key/value heads ``g`` (``g == h`` is MHA, ``g < h`` is GQA).
        ffn_hidden_dim: MLP hidden width ``F``.
        vocab_size: output vocabulary ``V`` of the LM head.
        gated_mlp: SwiGLU-style MLP with three ``H x F`` matrices instead of two.
        bias: linear layers carry biases (Megatron GPT) or not (Llama).
        layernorm: LayerNorm (weight and bias) rather than RMSNorm (weight only).
        tied_embeddings: the LM head reuses the input embedding. Under pipeline
            parallelism the last stage still holds its own copy.
        vocab_multiple: Megatron pads the vocabulary to a multiple of
            ``vocab_multiple * tp`` (its ``--make-vocab-size-divisible-by``);
            1 means no padding (torchtitan).
    """

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    gated_mlp: bool = True
    bias: bool = False
    layernorm: bool = False
    tied_embeddings: bool = False
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        positive = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size")
        for name in (*positive, "vocab_multiple"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for whole, part in (("dim", "n_heads"), ("n_heads", "n_kv_heads")):
            if getattr(self, whole) % getattr(self, part):
                raise ValueError(
                    f"{whole}={getattr(self, whole)} is not divisible by "
                    f"{part}={getattr(self, part)}; pick {part} that divides {whole}"
                )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of one of K or V: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    def forward_flops(self, length: int, end: int) -> int:
        """Exact forward FLOPs (2 per multiply-add) of tokens ``[end - length, end)``.

        Each query at absolute position ``t`` attends the ``t + 1`` keys of its
        whole causal prefix, so with ``s = length`` and ``P = end``::

            per layer:  4 s H^2                          # Q and O projections
                      + 4 s H g d                        # K and V projections
                      + 4 h d (s P - s (s - 1) / 2)      # QK^T and AV
                      + (3 if gated else 2) * 2 s H F    # MLP
            total:      L * per_layer + 2 s H V          # + LM head

        Summing this over any split of ``[0, P)`` gives ``forward_flops(P, P)``.
        """
        check_span(length, end)
        per_token, _ = self.flop_rates()
        return length * per_token + self.attention_flops(length, end)

    def attention_flops(self, length: int, end: int) -> int:
        """FLOPs of QK^T and AV of tokens ``[end - length, end)``: the part without weights."""
        check_span(length, end)
        keys_attended = length * end - length * (length - 1) // 2
        return keys_attended * self.flop_rates()[1]

    def flops_coefficients(self, end: int) -> tuple[float, float]:
        """``(a, b)`` with ``forward_flops(s, end) == a * s**2 + b * s``; ``a < 0``.

        ``a`` is negative because a longer segment ending at the same ``end``
        reaches back to earlier, cheaper positions.
        """
        per_token, per_query_key = self.flop_rates()
        return -per_query_key / 2, per_token + per_query_key * (end + 0.5)

    def flop_rates(self) -> tuple[int, int]:
        """FLOPs per token (projections, MLP, LM head) and per attended (query, key) pair."""
        per_layer_token = (
            4 * self.dim * self.dim
            + 4 * self.dim * self.n_kv_heads * self.head_dim
            + (3 if self.gated_mlp else 2) * 2 * self.dim * self.ffn_hidden_dim
        )
        per_token = self.n_layers * per_layer_token + 2 * self.dim * self.vocab_size
        return per_token, self.n_layers * 4 * self.n_heads * self.head_dim

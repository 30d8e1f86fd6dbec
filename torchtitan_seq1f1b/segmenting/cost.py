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
        n_heads: query heads ``h``; the head dim is ``d = H // h`` unless given.
        n_kv_heads: key/value heads ``g`` (``g == h`` is MHA, ``g < h`` is GQA).
        ffn_hidden_dim: MLP hidden width ``F`` (of one expert in an MoE layer).
        vocab_size: output vocabulary ``V`` of the LM head.
        gated_mlp: SwiGLU-style MLP with three ``H x F`` matrices instead of two.
        bias: linear layers carry biases (Megatron GPT) or not (Llama).
        layernorm: LayerNorm (weight and bias) rather than RMSNorm (weight only).
        tied_embeddings: the LM head reuses the input embedding. Under pipeline
            parallelism the last stage still holds its own copy.
        vocab_multiple: Megatron pads the vocabulary to a multiple of
            ``vocab_multiple * tp`` (its ``--make-vocab-size-divisible-by``);
            1 means no padding (torchtitan).
        qk_head_dim: width ``d`` of a query or key head, when not ``H // h``
            (Qwen3; MLA's nope and rope parts together).
        v_head_dim: width ``d_v`` of a value head (and of the attention
            output per head), when not ``d`` (MLA).
        experts: routed experts ``E`` of an MoE MLP; 0 is a dense MLP.
        experts_per_token: experts each token is routed to (top-k).
        shared_ffn_hidden_dim: hidden width of the shared experts every token
            also runs (0: none).
        window_layers: how many of the ``L`` layers attend through a sliding
            window (gpt_oss: every other one).
        window: keys a query of such a layer sees at most, itself included.
        linear_layers: how many of the ``L`` layers are linear attention
            (qwen3_5's GatedDeltaNet), priced with the attention's projections
            and heads: instead of QK^T and AV over the prefix, a recurrent
            state update per token, linear in the segment's length
            (:meth:`recurrence_flops`).
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
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    experts: int = 0
    experts_per_token: int = 1
    shared_ffn_hidden_dim: int = 0
    window_layers: int = 0
    window: int = 0
    linear_layers: int = 0

    def __post_init__(self) -> None:
        positive = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size")
        for name in (*positive, "vocab_multiple"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in ("qk_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be None or a positive int")
        if not is_int(self.window_layers) or not 0 <= self.window_layers <= self.n_layers:
            raise ValueError(f"window_layers={self.window_layers!r} must be an int in [0, n_layers]")
        unwindowed = self.n_layers - self.window_layers
        if not is_int(self.linear_layers) or not 0 <= self.linear_layers <= unwindowed:
            raise ValueError(f"linear_layers={self.linear_layers!r} must be an int in [0, {unwindowed}]")
        if self.window_layers and (not is_int(self.window) or self.window < 1):
            raise ValueError(f"window={self.window!r} must be a positive int with window_layers")
        for name in ("experts", "shared_ffn_hidden_dim"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 0")
        if not is_int(self.experts_per_token) or not 1 <= self.experts_per_token <= max(self.experts, 1):
            raise ValueError(
                f"experts_per_token={self.experts_per_token!r} must be in [1, max(experts, 1)]"
            )
        divisible = [("n_heads", "n_kv_heads")]
        if self.qk_head_dim is None:
            divisible.append(("dim", "n_heads"))
        for whole, part in divisible:
            if getattr(self, whole) % getattr(self, part):
                raise ValueError(
                    f"{whole}={getattr(self, whole)} is not divisible by "
                    f"{part}={getattr(self, part)}; pick {part} that divides {whole}"
                )

    @property
    def head_dim(self) -> int:
        """Width ``d`` of a query or key head."""
        return self.qk_head_dim if self.qk_head_dim is not None else self.dim // self.n_heads

    @property
    def value_head_dim(self) -> int:
        """Width ``d_v`` of a value head."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of V: ``n_kv_heads * value_head_dim``."""
        return self.n_kv_heads * self.value_head_dim

    @property
    def active_ffn_hidden_dim(self) -> int:
        """MLP hidden width one token runs: its routed experts' and the shared ones'."""
        routed = self.experts_per_token if self.experts else 1
        return routed * self.ffn_hidden_dim + self.shared_ffn_hidden_dim

    def forward_flops(self, length: int, end: int) -> int:
        """Exact forward FLOPs (2 per multiply-add) of tokens ``[end - length, end)``.

        Each query at absolute position ``t`` attends the ``t + 1`` keys of its
        whole causal prefix (``min(t + 1, window)`` in a sliding-window layer),
        so with ``s = length`` and ``P = end``::

            per layer:  2 s H h (d + d_v)                # Q and O projections
                      + 2 s H g (d + d_v)                # K and V projections
                      + 2 h (d + d_v) (s P - s (s - 1) / 2)  # QK^T and AV
                      + (3 if gated else 2) * 2 s H F_a  # MLP (F_a: active width)
                      + 2 s H E                          # MoE router
            total:      L * per_layer + 2 s H V          # + LM head

        For a dense model with ``d = d_v = H / h`` the projections are
        ``4 s H^2 + 4 s H g d`` and attention ``4 h d`` per (query, key) pair.

        Summing this over any split of ``[0, P)`` gives ``forward_flops(P, P)``.
        """
        check_span(length, end)
        return length * self.token_flops() + self.attention_flops(length, end)

    def attention_flops(self, length: int, end: int) -> int:
        """FLOPs of QK^T and AV (and linear attention's state updates) of tokens
        ``[end - length, end)``: the part without weights."""
        check_span(length, end)
        full, windowed = self.pair_rates()
        start = end - length
        keys = full * _keys_seen(start, end, end) + windowed * _keys_seen(start, end, self.window)
        return keys + length * self.recurrence_flops()

    def flops_coefficients(self, end: int) -> tuple[float, float]:
        """``(a, b)`` with ``forward_flops(s, end) == a * s**2 + b * s``; ``a < 0``.

        ``a`` is negative because a longer segment ending at the same ``end``
        reaches back to earlier, cheaper positions.
        """
        if self.window_layers:
            raise ValueError("sliding-window layers make the FLOPs not quadratic in the length")
        per_query_key = self.pair_rates()[0]
        per_token = self.token_flops() + self.recurrence_flops()
        return -per_query_key / 2, per_token + per_query_key * (end + 0.5)

    def token_flops(self) -> int:
        """FLOPs per token: projections, MLP and LM head."""
        head_widths = self.head_dim + self.value_head_dim
        per_layer_token = (
            2 * self.dim * (self.n_heads + self.n_kv_heads) * head_widths
            + (3 if self.gated_mlp else 2) * 2 * self.dim * self.active_ffn_hidden_dim
            + 2 * self.dim * self.experts
        )
        return self.n_layers * per_layer_token + 2 * self.dim * self.vocab_size

    def pair_rates(self) -> tuple[int, int]:
        """FLOPs per attended (query, key) pair, summed over the full-attention layers
        and over the sliding-window layers."""
        per_layer = 2 * self.n_heads * (self.head_dim + self.value_head_dim)
        full = self.n_layers - self.window_layers - self.linear_layers
        return full * per_layer, self.window_layers * per_layer

    def recurrence_flops(self) -> int:
        """FLOPs per token of the linear-attention layers' state updates: per head,
        four passes over its (d, d_v) state (decay, read, write, output)."""
        return self.linear_layers * 4 * 2 * self.n_heads * self.head_dim * self.value_head_dim


def _keys_seen(start: int, end: int, window: int) -> int:
    """Keys queries ``[start, end)`` see causally, at most ``window`` each: sum of min(t + 1, window)."""
    growing = max(min(end, window) - start, 0)  # queries t < window see t + 1 keys
    first = start + 1
    return growing * (2 * first + growing - 1) // 2 + (end - start - growing) * window

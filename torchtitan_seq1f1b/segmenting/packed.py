# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a segment costs when sequences pack several documents.

With a document mask, the query at position ``t`` attends only the keys of its
own document at or before ``t``: ``keys(t) = t - doc_start(t) + 1`` instead of
causal attention's ``t + 1``. A segment's attention cost then depends on the
documents in it, and a plan balanced for dense causal attention is not balanced
any more. :class:`PackedDocumentsCost` prices segments from ``keys(t)``, either
expected under a :class:`DocumentLengths` distribution or averaged over actual
document ids; docs/benchmarks.md ("Packed documents") shows what it changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING

from torchtitan_seq1f1b.segmenting.cost import check_span, is_int, TransformerCost

if TYPE_CHECKING:
    import torch

__all__ = ["DocumentLengths", "PackedDocumentsCost"]


@dataclass(frozen=True)
class DocumentLengths:
    """A distribution of document lengths (tokens, EOS included) in a packed stream.

    Args:
        lengths: distinct positive document lengths.
        probabilities: probability of each length; positive, summing to 1.
    """

    lengths: tuple[int, ...]
    probabilities: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "probabilities", tuple(float(p) for p in self.probabilities))
        if not self.lengths or not all(is_int(n) and n > 0 for n in self.lengths):
            raise ValueError(f"lengths={list(self.lengths)[:8]} must be non-empty positive ints")
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError("lengths must be distinct; add up the probabilities of repeats")
        if len(self.probabilities) != len(self.lengths):
            raise ValueError(
                f"{len(self.probabilities)} probabilities for {len(self.lengths)} lengths"
            )
        if not all(p > 0 and math.isfinite(p) for p in self.probabilities):
            raise ValueError("probabilities must be positive and finite")
        if abs(math.fsum(self.probabilities) - 1) > 1e-9:
            raise ValueError(
                f"probabilities sum to {math.fsum(self.probabilities)}, not 1; normalise them"
            )

    @classmethod
    def fixed(cls, length: int) -> DocumentLengths:
        """Every document has ``length`` tokens."""
        return cls((length,), (1.0,))

    @classmethod
    def from_samples(cls, samples: list[int] | tuple[int, ...]) -> DocumentLengths:
        """The empirical distribution of observed document lengths."""
        if not samples:
            raise ValueError("samples is empty; give at least one document length")
        counts: dict[int, int] = {}
        for n in samples:
            counts[n] = counts.get(n, 0) + 1
        lengths = tuple(sorted(counts))
        return cls(lengths, tuple(counts[n] / len(samples) for n in lengths))

    @classmethod
    def lognormal(cls, mean: float, sigma: float = 1.25, bins: int = 512) -> DocumentLengths:
        """A long-tailed mix: lognormal lengths with the given ``mean`` and log-space ``sigma``.

        Deterministic: ``bins`` equal-probability quantile bins, each at its
        conditional mean rounded to a whole token (at least 1), so the mean is
        ``mean`` to within half a token. ``sigma=1.25`` puts the median at
        0.46 x the mean and 4% of documents above 4 x the mean.
        """
        if not (mean >= 1 and math.isfinite(mean)):
            raise ValueError(f"mean={mean!r} must be a finite number >= 1")
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ValueError(f"sigma={sigma!r} must be a finite number > 0")
        if not is_int(bins) or bins < 1:
            raise ValueError(f"bins={bins!r} must be a positive int")
        normal = NormalDist()
        edges = [-math.inf, *(normal.inv_cdf(i / bins) for i in range(1, bins)), math.inf]

        def cdf(z: float) -> float:
            return 0.0 if z == -math.inf else 1.0 if z == math.inf else normal.cdf(z)

        # E[X; z_lo < Z < z_hi] for X = mean * exp(sigma Z - sigma^2 / 2).
        counts: dict[int, float] = {}
        for lo, hi in zip(edges, edges[1:]):
            part = mean * bins * (cdf(hi - sigma) - cdf(lo - sigma))
            n = max(1, round(part))
            counts[n] = counts.get(n, 0.0) + 1 / bins
        lengths = tuple(sorted(counts))
        return cls(lengths, tuple(counts[n] for n in lengths))

    @classmethod
    def parse(cls, spec: str) -> DocumentLengths:
        """``"lognormal:MEAN[:SIGMA]"`` or ``"fixed:LENGTH"`` (the simulator's ``--documents``)."""
        name, _, args = spec.partition(":")
        try:
            values = [float(a) for a in args.split(":")] if args else []
            if name == "lognormal" and len(values) in (1, 2):
                return cls.lognormal(*values)
            if name == "fixed" and len(values) == 1 and values[0] == int(values[0]):
                return cls.fixed(int(values[0]))
        except ValueError as error:
            raise ValueError(f"documents {spec!r}: {error}") from None
        raise ValueError(
            f"documents {spec!r}: expected lognormal:MEAN[:SIGMA] or fixed:LENGTH, "
            "e.g. lognormal:2048"
        )

    @property
    def mean(self) -> float:
        return math.fsum(n * p for n, p in zip(self.lengths, self.probabilities))

    def expected_keys(self, seq_len: int) -> list[float]:
        """``E[keys(t)]`` for ``t`` in ``[0, seq_len)`` in a window cut from a packed stream.

        Windows start at an arbitrary point of the stream, usually mid-document,
        and keys before the window do not exist. In a stationary renewal process
        the current document's age ``A`` (tokens before ``t`` in it) has
        ``P(A >= a) = E[(L - a)^+] / E[L]``, and ``keys(t) = min(A, t) + 1``, so
        ``E[keys(t)] = sum_{a=0..t} P(A >= a)``.
        """
        if not is_int(seq_len) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        mean = self.mean
        pairs = sorted(zip(self.lengths, self.probabilities))
        # Sweep a upwards, keeping sum p and sum p*n over the lengths n > a.
        mass = math.fsum(p for _, p in pairs)
        weighted = math.fsum(n * p for n, p in pairs)
        keys, total, i = [], 0.0, 0
        for a in range(seq_len):
            while i < len(pairs) and pairs[i][0] <= a:
                mass -= pairs[i][1]
                weighted -= pairs[i][0] * pairs[i][1]
                i += 1
            total += max(0.0, weighted - a * mass) / mean
            keys.append(total)
        return keys


@dataclass(frozen=True)
class PackedDocumentsCost:
    """Forward FLOPs of a segment whose queries see only their own document.

    ``forward_flops(length, end)`` counts a ``model``'s projections, MLP,
    linear attention and LM head for each token and attention for each
    (query, key) pair the document mask allows, from a prefix sum: O(1) per call. Build it with
    :meth:`expected` (a length distribution) or :meth:`from_keys` (actual ids,
    averaged over rows). With one document per row it equals ``model``'s causal
    cost exactly.

    Args:
        model: the transformer shape (FLOP rates per token and per pair).
        attention_prefix: ``seq_len + 1`` ints; entry ``t`` is the (softmax)
            attention FLOPs of queries ``[0, t)``.
    """

    model: TransformerCost
    attention_prefix: tuple[int, ...] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_prefix", tuple(self.attention_prefix))
        prefix = self.attention_prefix
        if len(prefix) < 2 or prefix[0] != 0:
            raise ValueError("attention_prefix must hold seq_len + 1 >= 2 entries starting at 0")
        if any(b < a for a, b in zip(prefix, prefix[1:])):
            raise ValueError("attention_prefix must be non-decreasing")

    @classmethod
    def expected(
        cls, model: TransformerCost, documents: DocumentLengths, seq_len: int
    ) -> PackedDocumentsCost:
        """Expected cost of windows of ``seq_len`` tokens cut from a stream of ``documents``."""
        # Prefix = causal prefix minus the pairs the mask removes: exact in the one-document
        # limit, where the removed pairs vanish. A sliding window caps the expected keys.
        full, windowed = model.pair_rates()
        removed, window_pairs, prefix = 0.0, 0.0, [0]
        for t, keys in enumerate(documents.expected_keys(seq_len)):
            removed += t + 1 - keys
            window_pairs += min(keys, model.window)
            causal = full * ((t + 1) * (t + 2) // 2) - round(full * removed)
            prefix.append(causal + round(windowed * window_pairs))
        return cls(model, prefix)

    @classmethod
    def from_keys(cls, model: TransformerCost, keys: torch.Tensor) -> PackedDocumentsCost:
        """Mean cost over rows of measured documents.

        keys: (rows, seq_len) integers, the keys each query sees under the
            document mask: :func:`torchtitan_seq1f1b.documents.keys_per_query`
            of the rows' document ids.
        """
        full, windowed = model.pair_rates()
        pairs = keys.sum(dim=0).cumsum(dim=0).tolist()
        window_pairs = keys.clamp(max=model.window).sum(dim=0).cumsum(dim=0).tolist()
        rows = keys.shape[0]
        flops = (full * p + windowed * w for p, w in zip(pairs, window_pairs))
        return cls(model, (0, *((f + rows // 2) // rows for f in flops)))

    @property
    def seq_len(self) -> int:
        return len(self.attention_prefix) - 1

    def attention_flops(self, length: int, end: int) -> int:
        """FLOPs of QK^T and AV of tokens ``[end - length, end)`` under the document
        mask, and of linear attention's state updates (per token, documents or not)."""
        check_span(length, end, self.seq_len)
        pairs = self.attention_prefix[end] - self.attention_prefix[end - length]
        return pairs + length * self.model.recurrence_flops()

    def forward_flops(self, length: int, end: int) -> int:
        """Forward FLOPs of tokens ``[end - length, end)``; sums exactly over any split."""
        return length * self.model.token_flops() + self.attention_flops(length, end)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Measured unit times and bytes of one model on one device, fitted to a small model.

A unit (one segment of one microbatch) of kind F, B, I or W over tokens
``[end - length, end)`` costs, per transformer block::

    seconds = per_token * length + per_pair * pairs(length, end)
              + per_prefix_pair * rectangle(length, end) + per_unit
    pairs     = length * end - length * (length - 1) / 2    # causal (query, key) pairs
    rectangle = length * end if end > length else 0         # a segment after a prefix

``per_token`` prices the projections and MLP, ``per_pair`` attention (whose
kernels run at another rate than GEMMs), ``per_prefix_pair`` what a kernel
that cannot skip masked scores pays for a segment after a prefix (torch's
CPU flash kernel with a mask computes all ``length * end`` scores and builds
the mask, where the first segment takes the causal path), and ``per_unit``
what a call costs whatever its size (launches, Python, GEMM inefficiency on
short segments).
The LM head with its loss is priced the same way without pairs. Bytes are per
token: activations autograd saves in a block and in the head, and the K/V a
block stores. Around the units, the pipeline runtime costs a rank
:class:`RuntimeOverhead` per action and per step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from torchtitan_seq1f1b.segmenting.cost import check_span

__all__ = [
    "ContextParallelCost",
    "KINDS",
    "NOT_CHARGED",
    "PROBED_SEGMENT_COUNTS",
    "RuntimeOverhead",
    "TimeModel",
    "UnitTime",
    "causal_pairs",
    "fit_nonnegative",
    "fit_unit_time",
    "prefix_rectangle",
]

KINDS = ("F", "B", "I", "W")
PROBED_SEGMENT_COUNTS = (1, 2, 4, 8, 16)
"""Segments of the uniform plans every measurement runs (those up to the sequence length)."""


def causal_pairs(length: int, end: int) -> int:
    """(query, key) pairs causal attention scores for tokens ``[end - length, end)``."""
    check_span(length, end)
    return length * end - length * (length - 1) // 2


def prefix_rectangle(length: int, end: int) -> int:
    """(query, key) scores of a segment after a prefix when none are skipped; 0 for a first segment."""
    check_span(length, end)
    return length * end if end > length else 0


NOT_CHARGED = (
    "not charged, both growing with k: recompute under activation checkpointing "
    "(units are timed without it) and FSDP's gradient accumulation after each backward unit"
)
"""What the time model leaves out of a step's prediction."""


@dataclass(frozen=True)
class UnitTime:
    """Seconds of one unit on one component (the module's formula)."""

    per_token: float
    per_pair: float
    per_unit: float
    per_prefix_pair: float = 0.0

    def __call__(self, length: int, end: int, share: int = 1) -> float:
        """Seconds on one of ``share`` ranks that split the unit's tokens evenly (context
        parallelism's head-tail pieces split the causal pairs evenly too): the per-token
        and per-pair terms divide by ``share``, the per-call cost does not."""
        spread = self.additive(length, end) + self.per_prefix_pair * prefix_rectangle(length, end)
        return spread / share + self.per_unit

    def additive(self, length: int, end: int) -> float:
        """The part that adds up over any split of the span: tokens and causal pairs."""
        return self.per_token * length + self.per_pair * causal_pairs(length, end)


def fit_nonnegative(
    columns: dict[str, list[float]], seconds: list[float], scale: list[float] | None = None
) -> dict[str, float]:
    """Least-squares coefficients of ``columns`` (one value per sample each) to ``seconds``.

    Residuals are relative (rows divided by ``scale``, by default the
    measured ``seconds``), so short samples, where fixed costs show, weigh as
    much as long ones. A term whose
    coefficient comes out negative is dropped (reported as 0) and the rest
    refitted: each stands for a cost that cannot be negative.
    """
    terms = list(columns)
    measured = torch.tensor(seconds, dtype=torch.float64)
    divisor = measured if scale is None else torch.tensor(scale, dtype=torch.float64)
    while True:
        design = torch.tensor([columns[t] for t in terms], dtype=torch.float64).T
        solution = torch.linalg.lstsq(design / divisor[:, None], (measured / divisor)[:, None])
        coefficients = dict(zip(terms, solution.solution[:, 0].tolist()))
        negative = [t for t in terms if coefficients[t] < 0]
        if not negative or len(terms) == 1:
            break
        terms.remove(min(negative, key=coefficients.__getitem__))
    return {t: max(coefficients.get(t, 0.0), 0.0) for t in columns}


def fit_unit_time(
    samples: list[tuple[int, int, float]],
    with_pairs: bool = True,
    scale: list[float] | None = None,
) -> UnitTime:
    """:func:`fit_nonnegative` of :class:`UnitTime` to ``(length, end, seconds)`` samples."""
    columns = {
        "per_token": [float(n) for n, _, _ in samples],
        "per_unit": [1.0] * len(samples),
    }
    if with_pairs:
        columns["per_pair"] = [float(causal_pairs(n, end)) for n, end, _ in samples]
        columns["per_prefix_pair"] = [float(prefix_rectangle(n, end)) for n, end, _ in samples]
    seconds = [t for _, _, t in samples]
    return UnitTime(**{"per_pair": 0.0, **fit_nonnegative(columns, seconds, scale)})


@dataclass(frozen=True)
class RuntimeOverhead:
    """Seconds the pipeline runtime adds on a rank outside the compute calls.

    Args:
        per_action: every action (F, B, I or W), whatever its size.
        per_token: every token of the action's segment (the bytes its messages
            and inputs move).
        per_step: once per step (splitting the batch, the loss normaliser).
    """

    per_action: float = 0.0
    per_token: float = 0.0
    per_step: float = 0.0

    def action_seconds(self, length: int) -> float:
        """Runtime seconds around one action over a segment of ``length`` tokens."""
        return self.per_action + self.per_token * length


@dataclass(frozen=True)
class ContextParallelCost:
    """Context parallelism of degree ``degree`` inside every segment, as a rank's unit times see it.

    A rank computes its head-tail share of each segment, ``1/c`` of the tokens and of
    the causal pairs. Per attention layer, a forward all-gathers the segment's K/V over
    the CP group and the step that computes their gradients (B, or I) reduce-scatters
    them; each collective moves ``(c-1)/c`` of the segment's K/V bytes per rank and takes
    ``latency + bytes / bytes_per_second`` seconds, not overlapped with compute.

    Args:
        degree: c, the CP ranks sharing every segment (1: no CP, nothing moved).
        bytes_per_second: what a rank moves per second in an all-gather or
            reduce-scatter over its CP group (NCCL's bus bandwidth). The default is an
            assumption between NVLink inside a node and InfiniBand across nodes.
        latency: seconds each collective costs whatever its size (also an assumption).
    """

    degree: int = 1
    bytes_per_second: float = 100e9
    latency: float = 20e-6

    def __post_init__(self) -> None:
        if not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"context parallel degree={self.degree!r} must be a positive int")
        if not self.bytes_per_second > 0 or not self.latency >= 0:
            raise ValueError(
                f"bytes_per_second={self.bytes_per_second} must be > 0 and "
                f"latency={self.latency} >= 0"
            )

    def exchange_seconds(self, kind: str, length: int, kv_row_bytes: float) -> float:
        """Seconds of the collective a ``kind`` unit of ``length`` tokens runs in one layer.

        ``kv_row_bytes``: K and V bytes of one token in one layer (the whole microbatch's
        tokens at that position). F all-gathers, B and I reduce-scatter, W moves nothing;
        0 without CP.
        """
        if self.degree == 1 or kind == "W":
            return 0.0
        moved = (self.degree - 1) / self.degree * length * kv_row_bytes
        return self.latency + moved / self.bytes_per_second


@dataclass(frozen=True)
class TimeModel:
    """Fitted unit times and per-token bytes of one (model shape, device, dtype).

    Args:
        block: per kind ("F", "B", "I", "W"), one transformer block's unit time.
        head: per kind, the final norm, LM head and loss (no attention).
        block_activation_bytes: bytes one token leaves saved for backward in a
            block (K/V store excluded).
        head_activation_bytes: the same for the head and loss.
        kv_bytes: K and V bytes one token occupies in one block's K/V store.
        kv_grad_bytes: the same for the store's fp32 bank of prefix gradients.
        runtime: what the pipeline runtime adds around the units (none where
            it was not measured).
        calibrated_for: what was measured (shape, device, dtype, ...): the cache key.
    """

    block: dict[str, UnitTime]
    head: dict[str, UnitTime]
    block_activation_bytes: float
    head_activation_bytes: float
    kv_bytes: float
    kv_grad_bytes: float
    runtime: RuntimeOverhead = RuntimeOverhead()
    calibrated_for: dict = field(default_factory=dict)

    def unit_seconds(
        self,
        kind: str,
        length: int,
        end: int,
        blocks: int,
        has_head: bool,
        is_first: bool = False,
        context_parallel: ContextParallelCost = ContextParallelCost(),
    ) -> float:
        """Time of a ``kind`` unit on a stage of ``blocks`` blocks (and the head if it is last),
        on one rank of ``context_parallel``'s group: its share and its K/V collectives.

        The first stage (``is_first``) takes token ids, which have no gradient: torch's split
        backward there computes nothing in I and the whole backward in W.
        """
        if is_first and kind == "I":
            return 0.0
        if is_first and kind == "W":
            kind = "B"
        share = context_parallel.degree
        seconds = blocks * (
            self.block[kind](length, end, share)
            + context_parallel.exchange_seconds(kind, length, self.kv_bytes)
        )
        if has_head:
            seconds += self.head[kind](length, end, share)
        return seconds

    def unit_activation_bytes(self, length: int, blocks: int, has_head: bool) -> float:
        """Bytes a unit of ``length`` tokens keeps until its backward on such a stage."""
        per_token = blocks * self.block_activation_bytes
        if has_head:
            per_token += self.head_activation_bytes
        return per_token * length

    def describe(self) -> str:
        """The measured figures besides unit times and bytes, and what is not charged, for logs."""
        runtime = self.runtime
        if runtime == RuntimeOverhead():
            measured = "runtime cost not charged"
        else:
            measured = (
                f"runtime {runtime.per_action * 1e3:.2f} ms per "
                f"action + {runtime.per_token * 1e6:.2f} us per token, "
                f"{runtime.per_step * 1e3:.1f} ms per step"
            )
        return f"{measured}; {NOT_CHARGED}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TimeModel:
        data = json.loads(text)
        for part in ("block", "head"):
            data[part] = {kind: UnitTime(**fit) for kind, fit in data[part].items()}
        data["runtime"] = RuntimeOverhead(**data.get("runtime", {}))
        return cls(**data)

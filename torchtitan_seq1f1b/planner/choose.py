# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pick k and the segment lengths: the fastest predicted plan that fits a memory budget."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torchtitan_seq1f1b.context_parallel import context_parallel_align
from torchtitan_seq1f1b.planner.estimate import estimate, PipelineShape, PlanEstimate
from torchtitan_seq1f1b.planner.time_model import ContextParallelCost, TimeModel
from torchtitan_seq1f1b.segmenting import SegmentCost, SegmentPlan, TransformerCost

__all__ = [
    "GIB",
    "NoPlanFitsError",
    "PARTITIONS",
    "PredictedTime",
    "Recommendation",
    "recommend",
    "segment_plan",
]

GIB = 2**30
PARTITIONS = ("uniform", "balanced", "time")
"""uniform: equal lengths; balanced: equal forward FLOPs; time: equal calibrated F + B time."""


class PredictedTime:
    """A segment's calibrated F + B time over the whole model, in picoseconds.

    It follows the :class:`~torchtitan_seq1f1b.segmenting.SegmentCost`
    protocol (hence the method's name) so that :meth:`SegmentPlan.balanced`
    equalises time instead of FLOPs. Only :meth:`UnitTime.additive` counts: the
    protocol needs a cost that adds up over any split, and the per-unit and
    prefix terms do not (every segment pays the first once; all segments but
    the first pay the second, which the balance leaves as it falls).
    """

    def __init__(self, model: TimeModel, n_layers: int):
        self.model = model
        self.n_layers = n_layers

    def forward_flops(self, length: int, end: int) -> int:
        seconds = 0.0
        for kind in ("F", "B"):
            block, head = self.model.block[kind], self.model.head[kind]
            seconds += self.n_layers * block.additive(length, end) + head.additive(length, end)
        return max(round(seconds * 1e12), 1)


def segment_plan(
    partition: str,
    seq_len: int,
    num_segments: int,
    flops: SegmentCost,
    model: TimeModel | None,
    n_layers: int,
    align: int = 1,
) -> SegmentPlan:
    """The ``partition`` plan of ``num_segments`` segments; "time" needs a calibrated ``model``."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition={partition!r} must be one of {PARTITIONS}")
    if partition == "uniform" or num_segments == 1:
        return SegmentPlan.uniform(seq_len, num_segments, align)
    if partition == "balanced":
        return SegmentPlan.balanced(seq_len, num_segments, flops, align)
    if model is None:
        raise ValueError('partition="time" needs a calibrated time model')
    return SegmentPlan.balanced(seq_len, num_segments, PredictedTime(model, n_layers), align)


class NoPlanFitsError(ValueError):
    """Even the most frugal plan needs more memory than the budget."""


@dataclass(frozen=True)
class Recommendation:
    """Every plan tried, fastest first; ``best`` is the fastest within the budget."""

    best: PlanEstimate
    fitting: tuple[PlanEstimate, ...]
    over_budget: tuple[PlanEstimate, ...]
    budget_bytes: int | None

    @property
    def runners_up(self) -> tuple[PlanEstimate, ...]:
        return self.fitting[1:]

    def table(self, rows: int = 8) -> str:
        """The best plans within the budget as a text table, the chosen one first."""
        baseline = next((e for e in self.fitting + self.over_budget if e.num_segments == 1), None)
        lines = [
            f"{'k':>3} {'partition':<9} {'step s':>8} {'vs k=1':>7} {'bubble':>7} "
            f"{'peak GiB/rank':<24} lengths"
        ]
        for row in self.fitting[:rows]:
            ratio = row.step_seconds / baseline.step_seconds if baseline else float("nan")
            peaks = " ".join(f"{b / GIB:.3f}" for b in row.peak_bytes)
            lengths = list(row.plan.lengths)
            shown = lengths if len(lengths) <= 8 else f"{lengths[:4]}...{lengths[-2:]}"
            lines.append(
                f"{row.num_segments:>3} {row.partition:<9} {row.step_seconds:>8.4f} "
                f"{ratio:>7.3f} {row.bubble_fraction:>7.3f} {peaks:<24} {shown}"
            )
        if self.over_budget:
            lines.append(
                f"({len(self.over_budget)} plans over the budget of "
                f"{self.budget_bytes / GIB:.3f} GiB per rank left out)"
            )
        return "\n".join(lines)


def recommend(
    shape: PipelineShape,
    model: TimeModel,
    flops: TransformerCost,
    seq_len: int,
    align: int = 1,
    budget_bytes: int | None = None,
    partitions: tuple[str, ...] = PARTITIONS,
    segment_counts: Iterable[int] = range(1, 17),
    context_parallel: ContextParallelCost = ContextParallelCost(),
) -> Recommendation:
    """Estimate every (k, partition) and pick the fastest plan that fits.

    ``budget_bytes`` bounds each rank's activations plus K/V store (None: no
    bound); lengths are multiples of ``align`` (and of 2c under
    ``context_parallel``), and k runs over ``segment_counts`` that leave every
    segment one such multiple or more. Raises :class:`NoPlanFitsError` naming the
    smallest need when no plan fits.
    """
    align = context_parallel_align(align, context_parallel.degree)
    tried: list[PlanEstimate] = []
    seen: set[tuple[int, ...]] = set()
    for k in sorted(k for k in set(segment_counts) if k * align <= seq_len):
        for partition in partitions:
            plan = segment_plan(partition, seq_len, k, flops, model, flops.n_layers, align)
            if plan.lengths in seen:  # e.g. k = 1, where every partition agrees
                continue
            seen.add(plan.lengths)
            tried.append(estimate(plan, partition, shape, model, context_parallel))
    tried.sort(key=lambda e: (e.step_seconds, e.num_segments))
    fitting = [e for e in tried if budget_bytes is None or max(e.peak_bytes) <= budget_bytes]
    over = [e for e in tried if e not in fitting]
    if not fitting:
        frugal = min(tried, key=lambda e: max(e.peak_bytes))
        raise NoPlanFitsError(
            f"no Seq1F1B plan with k in {sorted(set(segment_counts))} fits {budget_bytes / GIB:.3f} GiB of "
            f"activations and K/V per rank: the most frugal (k={frugal.num_segments}, "
            f"{frugal.partition}) needs {max(frugal.peak_bytes) / GIB:.3f} GiB; raise the "
            "budget, add pipeline stages or put fewer tokens in a microbatch"
        )
    return Recommendation(fitting[0], tuple(fitting), tuple(over), budget_bytes)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Time units where ranks share a host's CPU: inside short pipeline steps of the job's blocks.

Timed alone, a chain's units run faster than the same units inside a
pipeline step on a CPU, and not by one factor for every plan. Between
its units a rank runs the runtime (sends, receives, bookkeeping), keeps the
other units' tensors live, and shares the host's cores and memory bandwidth
with the ranks computing at the same time. So the units are timed where they
run: ``ranks`` local gloo ranks step
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1B` (for F and B) and
:class:`~torchtitan_seq1f1b.stepping.ScheduleSeq1F1BZBV` (for I and W) over
chains of the job's blocks, the last stage adding the final norm, LM head and
summed cross-entropy, at uniform k = 1, 2, 4, 8 and 16, and every compute
call is timed (:class:`~.compute_spans.ComputeRecorder`). A unit's time then
holds the contention it meets in a step.

The first stage of a split backward is left out: its I computes nothing and
its W the whole backward (:meth:`.time_model.TimeModel.unit_seconds`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.local_ranks import run_ranks
from benchmarks.planner_probes.compute_spans import ComputeRecorder, ComputeSpan
from torchtitan_seq1f1b.planner.llama_block import BlockChain, OutputHead, summed_cross_entropy
from benchmarks.planner_probes.probe_pipeline import probe_pipeline
from torchtitan_seq1f1b.planner.time_model import PROBED_SEGMENT_COUNTS
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B, ScheduleSeq1F1BZBV
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = ["PipelineUnitTimes", "measure_pipeline_units"]

_MICROBATCHES = 2
_WARMUP_STEPS = 1
_STEPS = 8
# Which kinds each schedule's steps are timed for: Seq1F1B runs whole backwards, the V splits them.
_PROBES = ((ScheduleSeq1F1B, 1, ("F", "B")), (ScheduleSeq1F1BZBV, 2, ("I", "W")))

_PlanSamples = dict[str, list[tuple[int, int, float, float]]]
_UnitKey = tuple[str, bool, int, int, int]  # kind, on the last stage?, k, length, end


@dataclass(frozen=True)
class PipelineUnitTimes:
    """Per kind, ``(length, end, seconds, plan seconds)`` of each timed unit shape: the median
    of its calls, and the sum of those medians over the units of its plan (its k).

    Args:
        block: one block's time: a chain's divided by its blocks.
        last_stage: a chain followed by the head (norm, LM head and loss).
    """

    block: _PlanSamples
    last_stage: _PlanSamples


class _FirstStage(BlockChain):
    """Blocks whose input takes a gradient, as the embedding's output does in a job: torch hands
    the first stage the probe's hidden states as they are, without one, and the first block's
    input gradient would go unmeasured. Same shapes as :class:`BlockChain`."""

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(h.detach().requires_grad_(), positions)


class _LastStage(nn.Module):
    """Blocks, final norm and LM head: (batch, seq_len, dim) -> (batch, seq_len, vocab) logits."""

    def __init__(self, shape: TransformerCost, count: int, attention_backend: str):
        super().__init__()
        self.chain = BlockChain(shape, count, attention_backend)
        self.head = OutputHead(shape)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.chain(h, positions))


class _TimedLoss:
    """Summed cross-entropy that records its seconds: the runtime computes it right after the
    last stage's forward, so it belongs to that F."""

    def __init__(self):
        self.seconds: list[float] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        loss = summed_cross_entropy(logits, target)
        self.seconds.append(time.perf_counter() - start)
        return loss


def _unit_seconds(
    spans: list[ComputeSpan],
    loss_seconds: list[float],
    plan: SegmentPlan,
    kinds: tuple[str, ...],
    last_stage: int,
) -> list[tuple[_UnitKey, float]]:
    """Each of one step's compute calls of ``kinds``, keyed (kind, on ``last_stage``?, the
    plan's k, length, end), with its seconds; the loss that followed a last-stage forward
    (``loss_seconds``, in call order) is part of that F. Stage 0's split backward is left out."""
    losses = iter(loss_seconds)
    found = []
    for span in spans:
        is_last = span.stage == last_stage
        took = span.end - span.start
        if span.kind == "F" and is_last:
            took += next(losses)
        if span.kind not in kinds or (span.stage == 0 and span.kind in "IW"):
            continue
        k = plan.num_segments
        segment = Unit.of_chunk(span.chunk, k).segment
        found.append(((span.kind, is_last, k, plan.lengths[segment], plan.ends[segment]), took))
    return found


def _probe_rank(
    rank: int,
    world_size: int,
    shape: TransformerCost,
    seq_len: int,
    microbatch_size: int,
    dtype: torch.dtype,
    chained_blocks: int,
    attention_backend: str,
) -> dict[_UnitKey, list[float]]:
    """Step every probe on this rank; seconds per (kind, last stage?, k, length, end)."""
    torch.manual_seed(rank)

    def stage_module(index: int, num_stages: int) -> nn.Module:
        if index == num_stages - 1:
            return _LastStage(shape, chained_blocks, attention_backend)
        if index == 0:
            return _FirstStage(shape, chained_blocks, attention_backend)
        return BlockChain(shape, chained_blocks, attention_backend)

    runs = []
    for schedule_cls, stages_per_rank, kinds in _PROBES:
        for k in (k for k in PROBED_SEGMENT_COUNTS if k <= seq_len):
            loss = _TimedLoss()
            pipeline = probe_pipeline(
                schedule_cls,
                rank,
                world_size,
                stages_per_rank,
                _MICROBATCHES,
                SegmentPlan.uniform(seq_len, k),
                stage_module,
                loss,
                (microbatch_size, shape.dim),
                dtype,
                shape.vocab_size,
            )
            runs.append((pipeline, loss, kinds))
    seconds: dict[_UnitKey, list[float]] = defaultdict(list)
    for step in range(_WARMUP_STEPS + _STEPS):
        # Round-robin, so a slow stretch of the host spreads over every probe.
        for pipeline, loss, kinds in runs:
            dist.barrier()
            loss.seconds.clear()
            with ComputeRecorder(pipeline.stages) as recorder:
                pipeline.step()
            if step < _WARMUP_STEPS:
                continue
            plan = pipeline.schedule.segment_plan
            found = _unit_seconds(recorder.spans, loss.seconds, plan, kinds, pipeline.last_stage)
            for key, took in found:
                seconds[key].append(took)
    return dict(seconds)


def measure_pipeline_units(
    shape: TransformerCost,
    seq_len: int,
    ranks: int,
    chained_blocks: int,
    microbatch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> PipelineUnitTimes:
    """Unit times of ``chained_blocks`` blocks per stage inside pipeline steps on ``ranks``
    local gloo ranks (one CPU thread each), with hidden states (``microbatch_size``, segment,
    ``shape.dim``) in ``dtype``."""
    per_rank = run_ranks(
        _probe_rank,
        ranks,
        shape,
        seq_len,
        microbatch_size,
        dtype,
        chained_blocks,
        attention_backend,
        timeout=1800,
    )
    merged: dict[_UnitKey, list[float]] = defaultdict(list)
    for found in per_rank:
        for key, values in found.items():
            merged[key] += values
    medians = {key: statistics.median(values) for key, values in sorted(merged.items())}
    plan_seconds: dict[tuple[str, bool, int], float] = defaultdict(float)
    for (kind, is_last, k, _, _), seconds in medians.items():
        plan_seconds[(kind, is_last, k)] += seconds
    block: _PlanSamples = defaultdict(list)
    last_stage: _PlanSamples = defaultdict(list)
    for (kind, is_last, k, length, end), seconds in medians.items():
        per = 1 if is_last else chained_blocks
        sample = (length, end, seconds / per, plan_seconds[(kind, is_last, k)] / per)
        (last_stage if is_last else block)[kind].append(sample)
    return PipelineUnitTimes(dict(block), dict(last_stage))

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The lines a Seq1F1B job logs when training ends, whichever torchtitan runs it.

On the shipped recall corpus they put the achieved loss next to the lowest
loss any model that cannot attend to earlier segments can reach
(:func:`~torchtitan_seq1f1b.data.recall.no_cross_segment_bound`): a loss
below it shows attention across segments at work.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from torchtitan_seq1f1b.data.recall import (
    full_attention_bound,
    no_cross_segment_bound,
    RecallSpec,
)
from torchtitan_seq1f1b.data.register import DATASET_NAMES
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["JobFacts", "run_summary"]


@dataclass(frozen=True)
class JobFacts:
    """What the summary reads from a job config (each adapter fills it from its own)."""

    dataset: str
    dataset_path: str | None
    seq_len: int
    steps: int
    checkpoint_folder: str  # as the job sees it: under its dump folder
    # torchtitan main shifts each packed document on its own (no_cross_segment_bound).
    shifted_per_document: bool = False


def run_summary(
    job: JobFacts,
    schedule: ScheduleSeq1F1B | None,
    first_step: int | None,
    last_step: int,
    recent_losses: Sequence[float],
) -> list[str]:
    """Summary lines; ``first_step`` is None when this process trained no step."""
    if first_step is None or schedule is None:
        folder = job.checkpoint_folder
        return [
            f"Seq1F1B: no step trained: the run resumed at step {last_step} from {folder} "
            f"and training.steps = {job.steps}; raise --training.steps "
            f"to continue, or remove {folder} to start over"
        ]
    if not recent_losses:
        return [f"Seq1F1B: trained steps {first_step}-{last_step}; no loss was logged"]
    loss = sum(recent_losses) / len(recent_losses)
    lines = [
        f"Seq1F1B: trained steps {first_step}-{last_step}; loss {loss:.4f} "
        f"(mean of the last {len(recent_losses)} logged steps)"
    ]
    if DATASET_NAMES.get(job.dataset) != "train":
        return lines
    spec = RecallSpec.parse(job.dataset_path)
    lengths = list(schedule.segment_plan.lengths)
    shifted = job.shifted_per_document
    try:
        lowest = full_attention_bound(spec, job.seq_len, shifted)
        blind = no_cross_segment_bound(spec, lengths, shifted)
    except ValueError as error:  # windows that do not hold whole documents
        return lines + [
            f"recall corpus: no bound for doc_tokens={spec.doc_tokens} at seq_len="
            f"{job.seq_len} ({error})"
        ]
    verdict = (
        f"{blind - loss:.4f} below it: the model attends across segments"
        if loss < blind
        else "not below it yet: train longer"
    )
    return lines + [
        f"recall corpus ({spec.to_path()}), segments {lengths}: no model that cannot "
        f"attend to earlier segments gets below loss {blind:.4f}; the lowest any model "
        f"can reach is {lowest:.4f}",
        f"achieved loss {loss:.4f} is {verdict}",
    ]

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The run summary (:mod:`torchtitan_seq1f1b.integration.summary`) of a torchtitan 0.2.2 job."""

import os
from collections.abc import Sequence

from torchtitan.config import JobConfig

from torchtitan_seq1f1b.integration import summary
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["run_summary"]


def run_summary(
    job_config: JobConfig,
    schedule: ScheduleSeq1F1B | None,
    first_step: int | None,
    last_step: int,
    recent_losses: Sequence[float],
) -> list[str]:
    """:func:`~torchtitan_seq1f1b.integration.summary.run_summary` of ``job_config``."""
    training = job_config.training
    job = summary.JobFacts(
        dataset=training.dataset,
        dataset_path=training.dataset_path,
        seq_len=training.seq_len,
        steps=training.steps,
        checkpoint_folder=os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder),
    )
    return summary.run_summary(job, schedule, first_step, last_step, recent_losses)

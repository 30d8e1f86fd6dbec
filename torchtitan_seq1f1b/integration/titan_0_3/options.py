# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The ``seq1f1b`` section of a torchtitan 0.3 job: the shared options plus the schedule.

torchtitan 0.3 resolves ``parallelism.pipeline_parallel_schedule`` with
torch's ``get_schedule_class`` while it sizes and splits the model, and later
releases reject names torch does not know when the config is parsed (PR
#4564). So that field keeps naming a torch schedule, the one whose stage
layout Seq1F1B uses ("1F1B", "Interleaved1F1B" or "ZBVZeroBubble"), and
``seq1f1b.schedule`` selects the Seq1F1B schedule run on that layout; "none"
leaves torchtitan's own schedule in charge.
"""

from dataclasses import dataclass
from typing import Literal

from torchtitan_seq1f1b.integration.options import Seq1F1BOptions

__all__ = ["NO_SCHEDULE", "Seq1F1BSection"]

NO_SCHEDULE = "none"


@dataclass
class Seq1F1BSection(Seq1F1BOptions):
    schedule: Literal[
        "Seq1F1B", "InterleavedSeq1F1B", "Seq1F1BZeroBubble", "Seq1F1BZBV", "none"
    ] = "Seq1F1B"
    """
    The Seq1F1B schedule to run when pipeline_parallel_degree > 1, on the stage
    layout of parallelism.pipeline_parallel_schedule: "Seq1F1B" and
    "Seq1F1BZeroBubble" on "1F1B", "InterleavedSeq1F1B" on "Interleaved1F1B",
    "Seq1F1BZBV" on "ZBVZeroBubble". "none" runs torchtitan's own schedule.
    """
    data: Literal["config", "recall", "images"] = "config"
    """
    "config" trains on the job's own dataset and tokenizer; "recall" on the
    long-range recall corpus and tokenizer this package ships (torchtitan's
    debug configs read its repository's test assets, which a pip install lacks);
    "images" a vision-language model on the synthetic image-text corpus it ships.
    """

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the multi-process exactness tests import: cases, the unsplit reference,
pipelined runs (:mod:`torchtitan_seq1f1b.exactness`) and the gloo launcher."""

from torchtitan_seq1f1b._launch import RankFailure, run_ranks
from torchtitan_seq1f1b.exactness import (
    Case,
    SCHEDULES,
    pipelined,
    pipelined_cases,
    reference,
)

__all__ = ["Case", "RankFailure", "SCHEDULES", "pipelined", "pipelined_cases", "reference", "run_ranks"]

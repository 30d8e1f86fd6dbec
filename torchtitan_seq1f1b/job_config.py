# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The ``[seq1f1b]`` section of a torchtitan 0.2.2 job config.

Point ``[job] custom_config_module`` at this module; every key is then also a
``--seq1f1b.<key>`` command-line flag. The section is read only when
``[parallelism] pipeline_parallel_schedule`` is one of the Seq1F1B schedules:
"Seq1F1B", "InterleavedSeq1F1B", "Seq1F1BZeroBubble" or "Seq1F1BZBV". A key
that is not below fails while torchtitan parses the config, naming the
closest valid one.
"""

from dataclasses import dataclass, field

from torchtitan_seq1f1b.integration.options import Seq1F1BOptions

__all__ = ["JobConfig", "Seq1F1BOptions"]


@dataclass
class JobConfig:
    seq1f1b: Seq1F1BOptions = field(default_factory=Seq1F1BOptions)

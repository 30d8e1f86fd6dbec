# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pipeline timelines and memory/bubble-vs-k charts as PNG files.

Run ``python -m torchtitan_seq1f1b.plot --help``; the charts are described in
``docs/benchmarks.md``. The only package that imports matplotlib.
"""

import matplotlib

# Files only, no display (CI machines have none); set before any pyplot import,
# which every module of this package does after this runs.
matplotlib.use("Agg")

from torchtitan_seq1f1b.tools.plot.cli import main  # noqa: E402
from torchtitan_seq1f1b.tools.plot.sweep import plot_sweep  # noqa: E402
from torchtitan_seq1f1b.tools.plot.timeline import (  # noqa: E402
    Action,
    measured_actions,
    plot_timeline,
    simulated_actions,
    TimelineData,
)

__all__ = [
    "Action",
    "TimelineData",
    "main",
    "measured_actions",
    "plot_sweep",
    "plot_timeline",
    "simulated_actions",
]

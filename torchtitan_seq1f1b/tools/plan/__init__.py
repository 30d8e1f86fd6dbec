# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The planner as a command: calibrate a model shape on this device and print the best plans.

``python -m torchtitan_seq1f1b.plan --help``; the planner itself is
:mod:`torchtitan_seq1f1b.planner`, which the adapters also run for
``num_segments = "auto"``.
"""

from torchtitan_seq1f1b.tools.plan.cli import main

__all__ = ["main"]

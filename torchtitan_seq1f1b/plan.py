# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan``: which k and segment lengths to run, measured on this device.

See :mod:`torchtitan_seq1f1b.tools.plan`.
"""

import sys

from torchtitan_seq1f1b.tools.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())

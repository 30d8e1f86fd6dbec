# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plot``: timeline and sweep charts; see :mod:`torchtitan_seq1f1b.tools.plot`."""

import sys

from torchtitan_seq1f1b.tools.plot.cli import main

if __name__ == "__main__":
    sys.exit(main())

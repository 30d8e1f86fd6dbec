# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.bench``: the real CPU benchmark; see :mod:`torchtitan_seq1f1b.tools.bench`."""

import sys

from torchtitan_seq1f1b.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.simulate``: pipeline timeline and memory simulator.

See :mod:`torchtitan_seq1f1b.tools.simulate`.
"""

import sys

from torchtitan_seq1f1b.tools.simulate.cli import main

if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m benchmarks.cpu_bench`` (from the repository's root)."""

import sys

from benchmarks.cpu_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

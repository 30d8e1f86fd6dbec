# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.tools.documents``: Seq1F1B under packed documents, as tables."""

import sys

from torchtitan_seq1f1b.tools.documents.cli import main

if __name__ == "__main__":
    sys.exit(main())

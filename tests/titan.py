# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan runs for the tests (see :mod:`torchtitan_seq1f1b.check.titan_runs`)."""

from torchtitan_seq1f1b.check.titan_runs import DEBUG_CONFIG, REPO, Run, RunFailed, TEST_ARGS, torchrun

__all__ = ["DEBUG_CONFIG", "REPO", "Run", "RunFailed", "TEST_ARGS", "torchrun"]

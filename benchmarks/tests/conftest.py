# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

# Calibrations go to a fresh directory here too, not the user's cache.
from tests.conftest import _calibration_cache  # noqa: F401

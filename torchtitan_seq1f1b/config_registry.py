# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What ``--module torchtitan_seq1f1b`` finds on torchtitan 0.3: the adapter's job configs.

torchtitan 0.3's config manager imports ``<module>.config_registry`` and calls
the function ``--config`` names (:mod:`.integration.titan_0_3.config_registry`).
"""

from torchtitan_seq1f1b.integration.titan_0_3.config_registry import seq1f1b_debug

__all__ = ["seq1f1b_debug"]

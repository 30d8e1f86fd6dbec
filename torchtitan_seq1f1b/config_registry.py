# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What ``--module torchtitan_seq1f1b`` finds on torchtitan 0.3: job configs by name.

torchtitan 0.3's config manager imports ``<module>.config_registry`` and calls
the function ``--config`` names: the adapter's own, or any config function of
torchtitan's model registries as a Seq1F1B job
(:mod:`.integration.titan_0_3.config_registry`).
"""

from torchtitan_seq1f1b.integration.titan_0_3 import config_registry as _adapter
from torchtitan_seq1f1b.integration.titan_0_3.config_registry import (
    seq1f1b_debug,
    seq1f1b_llama3_8b_128k,
)

__all__ = ["seq1f1b_debug", "seq1f1b_llama3_8b_128k"]

__getattr__ = _adapter.__getattr__

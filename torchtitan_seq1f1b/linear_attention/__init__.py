# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""GatedDeltaNet (linear attention) whose state crosses Seq1F1B segment cuts exactly.

- :mod:`.delta_rule`: the gated delta rule in plain torch (fla's chunk kernel's
  function, with initial and final state and document resets) and its backward;
- :mod:`.conv`: the short causal conv over a segment and its tail, within documents;
- :mod:`.carry`: the conv tail and recurrent state a layer carries from segment
  to segment of a microbatch, with their gradients, kept in the stage's K/V store;
- :mod:`.ops`: the two registered ops that read and write those carries;
- :mod:`.layer`: a segment-aware GatedDeltaNet layer built on them.
"""

from torchtitan_seq1f1b.linear_attention.delta_rule import (
    delta_rule_backward,
    delta_rule_forward,
    gated_delta_rule,
)
from torchtitan_seq1f1b.linear_attention.layer import GatedDeltaNetConfig, SegmentAwareGatedDeltaNet

__all__ = [
    "GatedDeltaNetConfig",
    "SegmentAwareGatedDeltaNet",
    "delta_rule_backward",
    "delta_rule_forward",
    "gated_delta_rule",
]

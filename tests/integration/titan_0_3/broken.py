# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The debug job with one part of Seq1F1B broken, as a negative control.

Used as ``--module tests.integration.titan_0_3.broken --config seq1f1b_debug``
with ``SEQ1F1B_BREAK`` set to one of:

- "normalizer": losses are divided by one token more than the step's global
  count (a 0.2% gradient scale: Adam hides it in the losses, not in grad_norm);
- "document_mask": one document per row (plain causal attention over the
  window) instead of the documents the positions start.
"""

import os

import torch

from torchtitan_seq1f1b.integration.titan_0_3 import attention, pipeline
from torchtitan_seq1f1b.integration.titan_0_3.config_registry import seq1f1b_debug

__all__ = ["seq1f1b_debug"]

BREAK = os.environ["SEQ1F1B_BREAK"]


if BREAK == "normalizer":
    loss_of = pipeline._ScalarLoss.__call__
    pipeline._ScalarLoss.__call__ = lambda self, output, target, global_valid_tokens: loss_of(
        self, output, target, global_valid_tokens=global_valid_tokens + 1
    )
elif BREAK == "document_mask":
    attention.positions_document_ids = lambda positions: torch.zeros_like(positions).view(
        -1, positions.shape[-1]
    )
else:
    raise ValueError(
        f"SEQ1F1B_BREAK={BREAK!r}: use normalizer or document_mask"
    )

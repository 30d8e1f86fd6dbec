# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The debug job with one part of Seq1F1B broken, as a negative control.

Used as ``--module tests.integration.titan_0_3.broken --config seq1f1b_debug``
with ``SEQ1F1B_BREAK`` set to one of:

- "segment_attention": every segment attends to its own tokens only;
- "double_division": the schedule divides the loss by the step's valid
  tokens although torchtitan's loss already divided by the global count;
- "document_mask": one document per row (plain causal attention over the
  window) instead of the documents the positions start.
"""

import os

import torch

from torchtitan_seq1f1b.integration.titan_0_3 import attention
from torchtitan_seq1f1b.integration.titan_0_3.config_registry import seq1f1b_debug
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.schedule import ScheduleSeq1F1B

__all__ = ["seq1f1b_debug"]

BREAK = os.environ["SEQ1F1B_BREAK"]

if BREAK == "segment_attention":
    KVStore.attach = lambda self, layer, k, v: (k, v)
elif BREAK == "double_division":
    ScheduleSeq1F1B._normalizer_for = lambda self, target: float((target != -100).sum())
elif BREAK == "document_mask":
    attention.positions_document_ids = lambda positions: torch.zeros_like(positions)
else:
    raise ValueError(
        f"SEQ1F1B_BREAK={BREAK!r}: use segment_attention, double_division or document_mask"
    )

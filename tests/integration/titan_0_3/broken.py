# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The debug job with one part of Seq1F1B broken, as a negative control.

Used as ``--module tests.integration.titan_0_3.broken --config seq1f1b_debug``
with ``SEQ1F1B_BREAK`` set to one of:

- "segment_attention": every segment attends to its own tokens only (the
  schedule starts a document at every segment start);
- "normalizer": losses are divided by one token more than the step's global
  count (a 0.2% gradient scale: Adam hides it in the losses, not in grad_norm);
- "document_mask": one document per row (plain causal attention over the
  window) instead of the documents the positions start.
"""

import os

import torch

from torchtitan_seq1f1b.integration.titan_0_3 import attention, pipeline
from torchtitan_seq1f1b.integration.titan_0_3.config_registry import seq1f1b_debug
from torchtitan_seq1f1b import schedules
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["seq1f1b_debug"]

BREAK = os.environ["SEQ1F1B_BREAK"]


def _cut_at_segments(ids: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """(batch, seq_len) document ids with a new document at every segment start too."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts[:, list(plan.offsets[1:])] = True
    return torch.cumsum(starts, dim=1)


if BREAK == "segment_attention":
    documents = schedules.MicrobatchDocuments
    schedules.MicrobatchDocuments = lambda ids, plan, _: documents(_cut_at_segments(ids, plan), plan)
elif BREAK == "normalizer":
    loss_of = pipeline._ScalarLoss.__call__
    pipeline._ScalarLoss.__call__ = lambda self, output, target, global_valid_tokens: loss_of(
        self, output, target, global_valid_tokens=global_valid_tokens + 1
    )
elif BREAK == "document_mask":
    attention.positions_document_ids = lambda positions: torch.zeros_like(positions)
else:
    raise ValueError(
        f"SEQ1F1B_BREAK={BREAK!r}: use segment_attention, normalizer or document_mask"
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One part of Seq1F1B broken inside a torchtitan job, as a negative control.

Used as the job's ``--experimental.custom_import tests.integration.titan_0_2.broken_titan`` (in
place of ``torchtitan_seq1f1b``, which the job's custom_config_module has
imported and installed by then), with ``SEQ1F1B_BREAK`` set to one of:

- "normalizer": gradients are divided by one token more than the step's count;
- "document_mask": block-causal models get one document per row (plain
  causal attention over the window) instead of the documents EOS tokens end.
"""

import os

import torch

from torchtitan_seq1f1b.integration.titan_0_2 import attention
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

BREAK = os.environ["SEQ1F1B_BREAK"]

if BREAK == "normalizer":
    _normalizer_for = ScheduleSeq1F1B._normalizer_for
    ScheduleSeq1F1B._normalizer_for = lambda self, target: _normalizer_for(self, target) + 1
elif BREAK == "document_mask":
    attention.eos_document_ids = lambda tokens, eos_id: torch.zeros_like(tokens)
else:
    raise ValueError(
        f"SEQ1F1B_BREAK={BREAK!r}: use normalizer or document_mask"
    )

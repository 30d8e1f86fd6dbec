# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Where torchtitan's attention masks meet the segment-aware attention, in every adapter.

torchtitan (0.2.2 and 0.3) hands every pipeline stage, and the unpipelined
model, what the model's ``get_attention_masks`` returned as the keyword
``attention_masks``. A converted model returns document ids there; a Seq1F1B
schedule takes them as its ``document_ids_kwarg``, and an unpipelined model
binds them with a forward pre-hook (:func:`bind_masks_as_documents`).
"""

import torch.nn as nn

from torchtitan_seq1f1b.attention import bind_documents, SegmentAwareAttention

__all__ = ["MASKS_KWARG", "bind_masks_as_documents", "is_inner_attention"]

MASKS_KWARG = "attention_masks"


def is_inner_attention(name: str, module: nn.Module) -> bool:
    """Whether ``name`` is a torchtitan attention's inner op (``<attention>.inner_attention``,
    whatever the block calls its attention) not yet converted."""
    return name.rpartition(".")[2] == "inner_attention" and not isinstance(
        module, SegmentAwareAttention
    )


def bind_masks_as_documents(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (``with_kwargs=True``): the ``attention_masks`` keyword,
    document ids (batch, seq_len), becomes ``module``'s packed documents."""
    bind_documents(module, kwargs.pop(MASKS_KWARG, None))
    return args, kwargs

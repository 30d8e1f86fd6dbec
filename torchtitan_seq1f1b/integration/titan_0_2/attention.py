# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan 0.2.2 llama3 model's attention made segment-aware, document masks included.

torchtitan 0.2.2 selects document masking with a flavor whose ``attn_type`` is
"flex" or "varlen" and whose ``attn_mask_type`` is "block_causal": the trainer
asks the model for ``get_attention_masks(tokens, tokenizer)`` (a flex
BlockMask or varlen metadata, documents ending at EOS tokens) and hands the
result to the model, or to every pipeline stage, as ``attention_masks``.
Neither kernel can attend a segment to its microbatch's earlier segments,
and neither trains on CPU (flex has no CPU backward, varlen no CPU kernel).
So such a model is converted (:func:`make_segment_aware`):

- its inner attention becomes :class:`SegmentAwareAttention` and every
  ``Attention`` takes the branch that passes only q, k, v (``attn_type =
  "sdpa"``; the model args keep "flex"/"varlen", so the trainer still asks
  for masks);
- ``get_attention_masks`` returns document ids (batch, seq_len) instead,
  derived exactly as torchtitan's ``get_document_mask_mod`` derives them
  (:func:`eos_document_ids`); with ``attn_mask_type = "causal"`` every row is
  one document;
- a Seq1F1B schedule takes them as its ``document_ids_kwarg``, so the model
  never sees them; an unpipelined model gets a forward pre-hook that binds
  them (:func:`parallelize_with_document_ids`, on CPU, where torchtitan's own
  kernels cannot train).

RoPE positions stay torchtitan's: global positions within the window.
"""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3.model.model import Attention
from torchtitan.protocols.train_spec import BaseModelArgs, ParallelizeFunction

from torchtitan_seq1f1b.attention import wrap_attention
from torchtitan_seq1f1b.integration.document_masks import (
    bind_masks_as_documents,
    is_inner_attention,
    MASKS_KWARG,
)

__all__ = [
    "MASKS_KWARG",
    "attention_problem",
    "eos_document_ids",
    "make_segment_aware",
    "parallelize_with_document_ids",
    "uses_document_ids",
]


def eos_document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document ids as torchtitan 0.2.2's ``get_document_mask_mod`` derives them.

    tokens: (batch, seq_len) token ids -> (batch, seq_len) int64, non-decreasing:
    the number of EOS tokens strictly before each position, so an EOS belongs to
    the document it ends and a row's first token is in document 0.
    """
    ends = torch.cumsum(tokens == eos_id, dim=1)
    return F.pad(ends[:, :-1], (1, 0))


def uses_document_ids(model_args: BaseModelArgs) -> bool:
    """Whether the trainer asks this model for attention masks (flex or varlen)."""
    return getattr(model_args, "attn_type", "sdpa") in ("flex", "varlen")


def attention_problem(model_args: BaseModelArgs) -> str | None:
    """Why Seq1F1B cannot reproduce this model's attention exactly, or None.

    (torchtitan's model rejects an attn_type other than sdpa, flex and varlen.)
    """
    if not uses_document_ids(model_args):
        return None
    attn_type, mask_type = model_args.attn_type, model_args.attn_mask_type
    if mask_type not in ("causal", "block_causal"):
        return (
            f"attn_mask_type={mask_type!r}: Seq1F1B reproduces 'causal' and "
            "'block_causal' (documents ending at EOS tokens) only"
        )
    if attn_type == "varlen" and mask_type != "block_causal":
        return (
            "attn_type='varlen' with attn_mask_type='causal', which torchtitan "
            "itself rejects (varlen needs 'block_causal')"
        )
    return None


def _document_ids_of(
    mask_type: str,
    input_batch: torch.Tensor,
    tokenizer: BaseTokenizer,
    extra_inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``get_attention_masks`` of a converted model: (batch, seq_len) document ids."""
    if mask_type == "causal":
        return torch.zeros_like(input_batch)
    if tokenizer.eos_id is None:
        raise ValueError(
            "attn_mask_type='block_causal' ends documents at EOS tokens, but the "
            "tokenizer has no eos_id"
        )
    return eos_document_ids(input_batch, tokenizer.eos_id)


def make_segment_aware(model: nn.Module, backend: str) -> int:
    """Convert a llama3 ``Transformer`` (or a pipeline part of one) in place.

    Call before torchtitan's ``parallelize_fn`` (AC and FSDP wrap the new
    modules). Returns the number of attention layers converted.
    """
    converted = wrap_attention(model, is_inner_attention, backend)
    model_args = model.model_args
    if uses_document_ids(model_args):
        for module in model.modules():
            if isinstance(module, Attention):
                module.attn_type = "sdpa"
        model.get_attention_masks = functools.partial(
            _document_ids_of, model_args.attn_mask_type
        )
    return converted


def parallelize_with_document_ids(parallelize_fn: ParallelizeFunction) -> ParallelizeFunction:
    """``parallelize_fn`` that first converts an unpipelined flex/varlen llama3 model.

    For a machine without an accelerator, where torchtitan's flex and varlen
    attention cannot train: the unpipelined model then computes the same
    block-causal attention as Seq1F1B's stages (the non-pipelined reference
    of a Seq1F1B run). Pipeline parts pass through: the pipelining function
    converts them.
    """

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig):
        model_args = getattr(model, "model_args", None)
        if parallel_dims.pp_enabled or not uses_document_ids(model_args):
            return parallelize_fn(model, parallel_dims, job_config)
        problem = attention_problem(model_args)
        if parallel_dims.cp_enabled:
            problem = (
                f"parallelism.context_parallel_degree={parallel_dims.cp}: the CPU "
                "document-masked attention runs whole sequences; set it to 1"
            )
        if problem:
            raise ValueError(f"model.flavor={job_config.model.flavor!r} on CPU: {problem}")
        options = getattr(job_config, "seq1f1b", None)  # absent without custom_config_module
        make_segment_aware(model, getattr(options, "attention_backend", "auto"))
        model = parallelize_fn(model, parallel_dims, job_config)
        model.register_forward_pre_hook(bind_masks_as_documents, with_kwargs=True)
        return model

    parallelize._seq1f1b = True
    return parallelize

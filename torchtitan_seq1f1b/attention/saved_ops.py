# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The forward ops of every attention backend: what op-level checkpointing must save.

Selective op checkpointing saves the outputs of the ops on its list and
recomputes everything else in backward. Neither torchtitan release lists
every op our backends dispatch, and an attention op missing from the list
reruns in every layer of every backward unit. The two adapters add these.
"""

import torch

from torchtitan_seq1f1b.attention.flash_attn import FlashAttnBackend

__all__ = ["attention_forward_ops"]

_ATEN = (
    "_scaled_dot_product_flash_attention_for_cpu",  # exact path on CPU
    "_efficient_attention_forward",  # exact path on CUDA, mask-free
    "_scaled_dot_product_efficient_attention",  # exact path on CUDA, SDPA with a mask
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention",  # varlen backend, dense
    "_flash_attention_forward",
)
# Registered by the packages that own them; absent ones are skipped.
_REGISTERED = (
    ("seq1f1b", "segment_attention"),  # every backend in compiled blocks, as one op
    ("torch_attn", "_varlen_attn"),  # varlen backend, packed documents
    # flash backend, dense and packed documents (namespace flash_attn before 2.8)
    *(
        (namespace, name)
        for namespace in ("flash_attn", "flashattn")
        for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")
    ),
)


def attention_forward_ops() -> set[torch._ops.OpOverload]:
    """Every op an attention backend dispatches for its forward, that is registered now."""
    FlashAttnBackend.installed()  # importing flash-attn registers its ops
    ops = {getattr(torch.ops.aten, name).default for name in _ATEN}
    for namespace, name in _REGISTERED:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops

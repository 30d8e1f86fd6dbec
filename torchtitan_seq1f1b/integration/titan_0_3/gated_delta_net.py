# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan's qwen3_5 GatedDeltaNet layers (0.3 and main) made segment-aware.

qwen3_5's ``GatedDeltaNet`` runs fla's Triton kernels from a zero state and
drops the final one, so a segment could not continue the one before it (and
nothing of it runs on CPU). :func:`convert_gated_delta_nets` swaps each for a
:class:`Qwen35GatedDeltaNet`: the segment-aware layer of
:mod:`torchtitan_seq1f1b.linear_attention` (its plain-torch recurrence and
conv), made of the original's modules and parameters, so torchtitan's
checkpoints, state-dict adapter, initialisation and sharding see the same layer.
On main the layer lives in ``qwen3_5/gdn.py``, takes a folded ``(T, dim)``
batch, and starts a document only at a position 0 followed by a 1.
"""

import sys

import torch
import torch.nn as nn
from torchtitan.protocols.module import Module

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig, SegmentAwareGatedDeltaNet

__all__ = [
    "Qwen35GatedDeltaNet",
    "convert_gated_delta_nets",
    "gated_delta_net_problems",
    "is_gated_delta_net",
]

QWEN3_5_MODEL = "torchtitan.models.qwen3_5.gdn" if FOLDED else "torchtitan.models.qwen3_5.model"
# fla's kernel: a child on 0.3, inside the inner module on main; the segment-aware ops replace it.
FLA_CHILDREN = ("kernel", "inner_gated_delta_net")


def _torchtitan_class() -> type | None:
    # Only a model built from that module (which needs fla) holds its layers.
    module = sys.modules.get(QWEN3_5_MODEL)
    return None if module is None else module.GatedDeltaNet


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is qwen3_5's GatedDeltaNet, converted or not."""
    original = _torchtitan_class()
    return isinstance(module, Qwen35GatedDeltaNet) or (
        original is not None and isinstance(module, original)
    )


class Qwen35GatedDeltaNet(SegmentAwareGatedDeltaNet, Module):
    """qwen3_5's GatedDeltaNet computed by :class:`SegmentAwareGatedDeltaNet`.

    It holds the original's own projections, convs, gated norm and
    parameters, with their initialisers and sharding configs, and is a
    torchtitan ``Module``: ``init_states`` and ``parallelize`` treat it as
    the layer it replaces (a converted model initialises bit for bit as
    torchtitan's own from the same seed). Only fla's kernel is left behind.
    """

    @classmethod
    def replacing(cls, original: nn.Module) -> "Qwen35GatedDeltaNet":
        """The layer computing what ``original`` (qwen3_5's GatedDeltaNet) computes,
        made of its modules and parameters."""
        config = GatedDeltaNetConfig(
            dim=original.in_proj_q.in_features,
            n_key_heads=original.in_proj_q.out_features // original.key_head_dim,
            n_value_heads=original.in_proj_v.out_features // original.value_head_dim,
            key_head_dim=original.key_head_dim,
            value_head_dim=original.value_head_dim,
            conv_kernel_size=original.conv_q.weight.shape[-1],
            norm_eps=original.norm.eps,
            # main's qwen3_5 resets its state only where a position 0 is followed by a 1.
            merge_single_token_documents=FOLDED,
        )
        # Built where the original lives: the handle buffer must be on its device.
        with torch.device(original.A_log.device):
            layer = cls(config)
        for name, child in original.named_children():
            if name not in FLA_CHILDREN:
                setattr(layer, name, child)
        layer.A_log, layer.dt_bias = original.A_log, original.dt_bias
        layer._param_init = original._param_init
        layer._sharding_config = original._sharding_config
        return layer

    def _distribute_states(self, parallel_dims) -> None:
        # The handle stands for the layer, not for data: a distributed copy of it
        # would not. The rest is distributed as torchtitan's layer is.
        handle = self._buffers.pop("handle")
        try:
            super()._distribute_states(parallel_dims)
        finally:
            self._buffers["handle"] = handle

    def forward(self, x_BLD: torch.Tensor, attention_masks=None) -> torch.Tensor:
        """Called as qwen3_5's block calls its GatedDeltaNet.

        Args:
            x_BLD: (batch, seq_len, dim), the running segment's tokens; on
                torchtitan main (seq_len, dim), one folded row.
            attention_masks: must be None: document ids reach the layer
                through the schedule or ``bind_documents``, not as masks.

        Returns:
            x_BLD's shape.
        """
        if attention_masks is not None:
            raise ValueError(
                "segment-aware GatedDeltaNet got attention_masks; its model's document ids "
                "must go to a Seq1F1B schedule's document_ids_kwarg or to bind_documents"
            )
        if FOLDED:
            return super().forward(x_BLD.unsqueeze(0)).squeeze(0)
        return super().forward(x_BLD)


def convert_gated_delta_nets(model: nn.Module) -> int:
    """Replace every qwen3_5 GatedDeltaNet block mixer (``layers.<i>.attn``) of a
    torchtitan 0.3 or main decoder (or pipeline part) in place; returns how many."""
    original = _torchtitan_class()
    if original is None:
        return 0
    converted = 0
    for block in getattr(model, "layers", {}).values():
        mixer = getattr(block, "attn", None)
        if isinstance(mixer, original):
            block.attn = Qwen35GatedDeltaNet.replacing(mixer)
            converted += 1
    return converted


def gated_delta_net_problems(model_config, tp: int, cp: int) -> list[str]:
    """Why a Seq1F1B job cannot run a model config holding GatedDeltaNet layers
    (``layers[i].delta_net``) at TP degree ``tp`` and CP degree ``cp``."""
    layers = [i for i, layer in enumerate(getattr(model_config, "layers", ()))
              if getattr(layer, "delta_net", None) is not None]
    if not layers:
        return []
    problems = []
    if cp > 1:
        problems.append(
            f"parallelism.context_parallel_degree={cp} with GatedDeltaNet layers {layers}: "
            "their recurrence runs each segment on one rank, from the state the segment "
            "before left, so Seq1F1B cannot cut a segment over CP ranks; set "
            "--parallelism.context_parallel_degree 1 (longer sequences: more segments)"
        )
    if tp > 1:
        problems.append(
            f"parallelism.tensor_parallel_degree={tp} with GatedDeltaNet layers {layers}: "
            "the segment-aware GatedDeltaNet is not sharded by heads; set "
            "--parallelism.tensor_parallel_degree 1"
        )
    return problems

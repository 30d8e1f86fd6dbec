# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's op-level selective checkpointing, saving Seq1F1B's attention too.

``SelectiveAC`` saves the ops its ``get_save_ops`` names; the ops our attention
backends dispatch are not all among them, and attention would rerun in every
layer of every backward unit.
"""

import dataclasses
from dataclasses import dataclass

from torchtitan.distributed.activation_checkpoint import SelectiveAC

from torchtitan_seq1f1b.attention import attention_forward_ops

__all__ = ["SegmentAttentionSAC", "saving_attention"]


class SegmentAttentionSAC(SelectiveAC):
    """``SelectiveAC`` whose save set also holds every attention backend's forward ops."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | attention_forward_ops()


def saving_attention(config):
    """``config`` (a job's ``activation_checkpoint``), with ``SelectiveAC`` replaced by
    :class:`SegmentAttentionSAC` on the same options; any other policy as it is."""
    if type(config) is not SelectiveAC.Config:
        return config
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return SegmentAttentionSAC.Config(**options)

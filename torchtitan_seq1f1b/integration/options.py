# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The ``[seq1f1b]`` options: one dataclass for every torchtitan adapter.

torchtitan 0.2.2 reads them as a TOML section and ``--seq1f1b.<key>`` flags
(:mod:`torchtitan_seq1f1b.job_config`); torchtitan 0.3 as the ``seq1f1b``
section of its trainer config, which adds the schedule name
(:mod:`torchtitan_seq1f1b.integration.titan_0_3.options`).
"""

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Seq1F1B"]


@dataclass
class Seq1F1B:
    num_segments: int = 4
    """
    Segments k every microbatch's sequence is cut into. The first pipeline
    stage then holds (p + k - 1) / k microbatches of activations instead of p,
    and the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(m*k+p-1).
    """

    partition: Literal["balanced", "uniform"] = "balanced"
    """
    How the sequence is cut. "balanced" gives early segments more tokens so
    that every segment costs the same FLOPs under causal attention (computed
    from the model's real dims and training.seq_len); "uniform" cuts equal lengths.
    """

    attention_backend: Literal["auto", "flash", "varlen", "sdpa"] = "auto"
    """
    Kernel for attention over a segment and its prefix. "auto" takes
    FlashAttention's varlen kernel on GPU when flash-attn is installed, then
    torch's varlen_attn, then exact SDPA (the CPU path).
    """

    align: int = 1
    """
    Every segment length is a multiple of this. The tensor-parallel degree is
    multiplied in automatically (sequence parallel shards each segment over the
    TP ranks); raise it to match a kernel tile (e.g. 128).
    """

    segment_lengths: list[int] = field(default_factory=list)
    """
    Explicit segment lengths (summing to training.seq_len), overriding
    num_segments and partition, e.g. a plan measured on the target hardware.
    """

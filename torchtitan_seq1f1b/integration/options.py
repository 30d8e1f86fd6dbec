# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The ``[seq1f1b]`` options: one dataclass for every torchtitan adapter.

torchtitan 0.2.2 reads them as a TOML section and ``--seq1f1b.<key>`` flags
(:mod:`torchtitan_seq1f1b.job_config`); torchtitan 0.3 as the ``seq1f1b``
section of its trainer config, which adds the schedule name
(:mod:`torchtitan_seq1f1b.integration.titan_0_3.options`).
"""

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["KERNEL_TILE", "Seq1F1BOptions"]

KERNEL_TILE = 128
"""Tokens per tile of the CUDA attention kernels' query and key blocks."""


@dataclass
class Seq1F1BOptions:
    num_segments: int | Literal["auto"] = 4
    """
    Segments k every microbatch's sequence is cut into. The first pipeline
    stage then holds (p + k - 1) / k microbatches of activations instead of p,
    and the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(m*k+p-1). "auto" lets
    the planner pick k (1 to 16): it times a rank's blocks (at most 4) and
    the LM head of the model on this device (cached), predicts every plan's
    step time and memory under the schedule's real order, and takes the
    fastest that fits memory_budget_gib; the job logs the choice and the
    runners-up.
    """

    partition: Literal["balanced", "uniform", "time", "auto"] = "balanced"
    """
    How the sequence is cut. "balanced" gives early segments more tokens so
    that every segment costs the same FLOPs under causal attention (computed
    from the model's real dims and training.seq_len); "uniform" cuts equal
    lengths; "time" equalises calibrated forward + backward time on this
    device (attention and GEMMs run at different rates); "auto" lets the
    planner take whichever of the three is fastest.
    """

    memory_budget_gib: float | None = None
    """
    For num_segments = "auto": activations plus K/V bytes per pipeline rank
    the plan must fit. Unset: the device's free memory after this rank's
    parameters, gradients and Adam states (on CPU: free RAM per local rank).
    """

    attention_backend: Literal["auto", "flash", "varlen", "sdpa"] = "auto"
    """
    Kernel for attention over a segment and its prefix. "auto" takes
    FlashAttention's varlen kernel on GPU when flash-attn is installed, then
    torch's varlen_attn, then exact SDPA (the CPU path).
    """

    align: int = 0
    """
    Every segment length is a multiple of this. 0 (the default) means 128,
    the attention kernels' tile, on CUDA when the sequence holds
    num_segments such segments, and 1 elsewhere. The tensor-parallel degree
    is multiplied in automatically (sequence parallel shards each segment
    over the TP ranks).
    """

    segment_lengths: list[int] = field(default_factory=list)
    """
    Explicit segment lengths (summing to training.seq_len), overriding
    num_segments and partition, e.g. a plan measured on the target hardware.
    """

    def segment_align(self, tp: int, seq_len: int, on_cuda: bool) -> int:
        """What every segment length is a multiple of: ``align`` (resolved) times into ``tp``."""
        align = self.align
        if not isinstance(align, int) or align < 0:
            raise ValueError(
                f"seq1f1b.align={align!r} must be an integer >= 0 (0: {KERNEL_TILE} on "
                "CUDA, 1 elsewhere)"
            )
        if align == 0:
            segments = 1 if self.num_segments == "auto" else self.num_segments
            fits = seq_len % KERNEL_TILE == 0 and segments * KERNEL_TILE <= seq_len
            align = KERNEL_TILE if on_cuda and fits else 1
        return math.lcm(align, tp)

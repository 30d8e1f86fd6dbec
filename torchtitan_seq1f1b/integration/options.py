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

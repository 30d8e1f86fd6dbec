# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Cutting a step's inputs into units and merging the units' outputs back.

torch's runtime splits a batch into microbatches along the batch dim; Seq1F1B
then cuts every microbatch into the plan's segments along ``seq_dim``. A unit's
inputs are that microbatch's tensors sliced to the segment: positional inputs,
targets, and keyword tensors with ``seq_len`` entries on ``seq_dim`` (but those
named whole); other values go to every segment unchanged. Under context parallelism a unit gets
this rank's head-tail share of its segment
(:class:`~torchtitan_seq1f1b.context_parallel.HeadTail`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import merge_chunks

from torchtitan_seq1f1b.context_parallel import HeadTail
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["SegmentSplitter"]


@dataclass(frozen=True)
class SegmentSplitter:
    """Splits microbatches into segments and merges segment outputs.

    Args:
        plan: how every sequence is cut.
        seq_dim: sequence dim of inputs, targets and outputs.
        positions_kwarg: keyword through which the model takes global token
            positions (RoPE); when set and a microbatch passes none, segment
            j gets ``offset_j + arange(len_j)`` of shape (1, len_j), or the
            positions of this rank's share under context parallelism.
        context: this rank's head-tail share of every segment under context
            parallelism; None gives units whole segments.
        whole_kwargs: keyword tensors that go to every segment uncut, whatever
            their shape.
    """

    plan: SegmentPlan
    seq_dim: int
    positions_kwarg: str | None = None
    context: HeadTail | None = None
    whole_kwargs: frozenset[str] = frozenset()

    @property
    def num_segments(self) -> int:
        return self.plan.num_segments

    def is_sequence_shaped(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > self.seq_dim
            and value.shape[self.seq_dim] == self.plan.seq_len
        )

    def input_error(self, args: tuple, target: Any) -> str | None:
        """Why a step's whole-batch inputs do not fit the plan, if they do not."""
        named = [("target", target)] + [(f"input {i}", a) for i, a in enumerate(args)]
        for what, tensor in named:
            if isinstance(tensor, torch.Tensor) and not self.is_sequence_shaped(tensor):
                return (
                    f"{what} of shape {tuple(tensor.shape)} does not have "
                    f"seq_len={self.plan.seq_len} tokens on dim "
                    f"seq_dim={self.seq_dim}; build the SegmentPlan for the "
                    "training sequence length"
                )
        return None

    def _split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        segments = torch.split(tensor, self.plan.lengths, dim=self.seq_dim)
        if self.context is None:
            return segments
        return tuple(self.context.share(segment, self.seq_dim) for segment in segments)

    def split_args(self, mb_args: tuple) -> list[tuple]:
        """One microbatch's positional args -> one tuple per segment."""
        per_arg = [
            self._split(a) if isinstance(a, torch.Tensor) else (a,) * self.num_segments
            for a in mb_args
        ]
        return [tuple(arg[j] for arg in per_arg) for j in range(self.num_segments)]

    def split_kwargs(self, mb_kwargs: dict, device: torch.device) -> list[dict]:
        """One microbatch's keyword args -> one dict per segment, positions added."""
        segments: list[dict] = [{} for _ in range(self.num_segments)]
        for name, value in mb_kwargs.items():
            parts = (
                self._split(value)
                if name not in self.whole_kwargs and self.is_sequence_shaped(value)
                else (value,) * self.num_segments
            )
            for segment, part in zip(segments, parts):
                segment[name] = part
        if self.positions_kwarg and self.positions_kwarg not in mb_kwargs:
            for segment, start, length in zip(segments, self.plan.offsets, self.plan.lengths):
                segment[self.positions_kwarg] = self._positions(start, length, device)[None]
        return segments

    def _positions(self, start: int, length: int, device) -> torch.Tensor:
        if self.context is None:
            return torch.arange(start, start + length, device=device)
        return self.context.positions(start, length, device)

    def merge_outputs(self, output_chunks: list, merge_spec: Any) -> Any:
        """Unit outputs in chunk order -> the whole batch's output (under context
        parallelism: this rank's shares, segment after segment)."""
        k = self.num_segments
        per_microbatch = [
            torch.cat(output_chunks[i : i + k], dim=self.seq_dim)
            for i in range(0, len(output_chunks), k)
        ]
        return merge_chunks(per_microbatch, merge_spec)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A segment's K/V across the CP group: all-gather forward, reduce-scatter backward.

Attention under context parallelism gathers each segment's keys and values
from every CP rank into the K/V store, so every rank attends its pieces to the
whole prefix; the key gradients each rank computes are partial sums, which a
reduce-scatter adds up and hands back as each rank's share. Both run inside the
attention op's forward and backward, which compute their own gradients, so
neither is differentiable.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_seq1f1b.context_parallel.layout import HeadTail

__all__ = ["ContextGroup", "gather_segment", "reduce_scatter_segment"]

# torch 2.13 renamed these (the old names warn there); earlier releases have the old ones.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def gather_segment(share: torch.Tensor, group, layout: HeadTail, dim: int) -> torch.Tensor:
    """(..., L / c, ...) this rank's share -> (..., L, ...) the whole segment, in sequence
    order, on every rank of ``group``."""
    gathered = share.new_empty((layout.degree, *share.shape))
    # The collectives concatenate along dim 0: the ranks' shares, stacked, flattened.
    _all_gather(gathered.flatten(0, 1), share.contiguous(), group=group)
    return layout.sequence_order(gathered, dim)


def reduce_scatter_segment(
    partial: torch.Tensor, group, layout: HeadTail, dim: int
) -> torch.Tensor:
    """(..., L, ...) this rank's partial gradient of a whole segment -> (..., L / c, ...)
    the sum over ``group`` of everyone's, at this rank's share."""
    stacked = layout.rank_order(partial, dim).contiguous()
    share = stacked.new_empty(stacked.shape[1:])
    _reduce_scatter(share, stacked.flatten(0, 1), group=group)
    return share


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its CP group: the layout of its shares and the group."""

    layout: HeadTail
    group: dist.ProcessGroup

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, L / c, kv_heads, head_dim) shares of a segment's k and v -> the whole
        segment's, (batch, L, kv_heads, head_dim), in one all-gather."""
        return gather_segment(torch.stack((k, v)), self.group, self.layout, 2).unbind(0)

    def reduce_scatter(
        self, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, L, kv_heads, head_dim) partial gradients of a segment's k and v -> the
        summed gradients of this rank's shares, in one reduce-scatter."""
        stacked = torch.stack((grad_k, grad_v))
        return reduce_scatter_segment(stacked, self.group, self.layout, 2).unbind(0)

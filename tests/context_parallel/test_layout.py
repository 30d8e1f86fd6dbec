# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Head-tail pieces per segment, and a segment gathered and reduce-scattered on gloo."""

import pytest
import torch
import torch.distributed as dist

from torchtitan_seq1f1b.context_parallel import gather_segment, HeadTail, reduce_scatter_segment
from torchtitan_seq1f1b.local_ranks import run_ranks


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_shares_cover_each_segment_once_with_equal_causal_work(degree):
    start, length = 24, 8 * degree
    layouts = [HeadTail(degree, r) for r in range(degree)]
    positions = torch.cat([layout.positions(start, length) for layout in layouts])
    assert sorted(positions.tolist()) == list(range(start, start + length))
    # Keys a causal query attends, summed over each rank's queries: equal on every rank.
    work = {int((layout.positions(start, length) + 1).sum()) for layout in layouts}
    assert len(work) == 1


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_shares_and_orders_invert_each_other(degree):
    segment = torch.randn(2, 6 * degree, 3, 4)
    layouts = [HeadTail(degree, r) for r in range(degree)]
    shares = [layout.share(segment, 1) for layout in layouts]
    for layout, share in zip(layouts, shares):
        assert torch.equal(segment[:, layout.positions(0, segment.shape[1])], share)
        assert torch.equal(layout.sequence_order(torch.stack(shares), 1), segment)
        assert torch.equal(layout.rank_order(segment, 1), torch.stack(shares))


def test_a_segment_the_pieces_cannot_cut_names_the_multiple():
    with pytest.raises(ValueError, match="multiples of 2 \\* degree = 4"):
        HeadTail(2, 0).share(torch.zeros(1, 6), 1)
    with pytest.raises(ValueError, match="CP rank 2 is outside degree 2"):
        HeadTail(2, 2)


def _gather_and_reduce_scatter(rank, world_size):
    layout = HeadTail(world_size, rank)
    torch.manual_seed(0)
    segment = torch.randn(2, 4 * world_size, 3, 5, dtype=torch.float64)
    partials = torch.randn(world_size, *segment.shape, dtype=torch.float64)
    gathered = gather_segment(layout.share(segment, 1), dist.group.WORLD, layout, 1)
    reduced = reduce_scatter_segment(partials[rank], dist.group.WORLD, layout, 1)
    return (
        torch.equal(gathered, segment),
        torch.allclose(reduced, layout.share(partials.sum(0), 1), rtol=1e-15, atol=0),
    )


def test_gather_restores_the_segment_and_reduce_scatter_sums_each_share():
    for gathered_right, reduced_right in run_ranks(_gather_and_reduce_scatter, 2, timeout=120):
        assert gathered_right and reduced_right

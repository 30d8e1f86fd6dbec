# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""When each rank posts its receives: at the start of the step on CPU (gloo).

torch's lowering posts a unit's receive right before the compute that needs
it. gloo matches such a late receive through the sender's progress thread,
and when the sender's own compute thread holds its core, that thread waits
for a scheduler slice: on the 2-core benchmark host a segment's activation
arrived 5-6 ms after the receiver asked for it, and a step at k = 8 (pp = 2,
m = 2) ran 3% longer than with the receives posted when the step starts,
which are already waiting when each send is issued. gloo's sends and
receives are independent asynchronous operations, matched per (sender,
receiver) pair in posting order, so moving receives ahead in their own order
changes no match and cannot deadlock.

CUDA keeps torch's placement: NCCL runs the point-to-point operations between
two ranks in order on one stream, where a receive posted early would hold up
the sends queued behind it.
"""

from torchtitan_seq1f1b._torch_compat import _Action, _ComputationType

__all__ = ["receives_first"]

_RECEIVES = (_ComputationType.RECV_F, _ComputationType.RECV_B)


def receives_first(order: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
    """Each rank's lowered actions with its receives moved to the front, in their order."""
    return {
        rank: [a for a in actions if a.computation_type in _RECEIVES]
        + [a for a in actions if a.computation_type not in _RECEIVES]
        for rank, actions in order.items()
    }

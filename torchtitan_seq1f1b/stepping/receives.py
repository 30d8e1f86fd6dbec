# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""When each rank posts its receives: at the start of the step on CPU (gloo).

torch's lowering posts a unit's receive right before the compute that needs
it. gloo matches such a late receive through the sender's progress thread,
which waits for a scheduler slice while the sender's compute thread holds its
core, so the activation arrives late; receives posted when the step starts
are already waiting when each send is issued. gloo's sends and
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

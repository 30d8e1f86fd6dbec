# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How many graphs torch.compile has built in this process (dynamo's own counter), and
how many one code object may hold."""

import torch._dynamo
from torch._dynamo.utils import counters

__all__ = ["compiled_graphs", "recompile_limit"]


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far: one per first compile and per recompile."""
    return counters["stats"]["unique_graphs"]


def recompile_limit(limit: int):
    """A context in which one code object may hold ``limit`` compiled graphs (default 8)."""
    return torch._dynamo.config.patch(recompile_limit=limit)

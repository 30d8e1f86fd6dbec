# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How many graphs torch.compile has built in this process (dynamo's own counter)."""

from torch._dynamo.utils import counters

__all__ = ["compiled_graphs"]


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far: one per first compile and per recompile."""
    return counters["stats"]["unique_graphs"]

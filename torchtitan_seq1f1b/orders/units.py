# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The unit sequences every order walks: forwards in unit order, backwards
FIFO over microbatches and LIFO over segments (segment j's K/V gradients come
from segments j+1..k-1)."""

from torchtitan_seq1f1b.actions import Unit

__all__ = ["backward_units", "check_positive", "forward_units"]


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


def forward_units(n_microbatches: int, num_segments: int) -> list[Unit]:
    return [Unit(i, j) for i in range(n_microbatches) for j in range(num_segments)]


def backward_units(n_microbatches: int, num_segments: int) -> list[Unit]:
    return [
        Unit(i, j)
        for i in range(n_microbatches)
        for j in reversed(range(num_segments))
    ]

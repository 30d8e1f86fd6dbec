# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The key-value store the default process group was created with."""

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

__all__ = ["default_store"]


def default_store() -> dist.Store:
    """The default process group's store (set, wait), shared by every rank."""
    return _get_default_store()

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The accelerator torch finds, asked the way torchtitan asks it."""

from torch._utils import _get_available_device_type

__all__ = ["available_device_type"]


def available_device_type() -> str | None:
    """"cuda", "xpu", "mps", ... or None without an accelerator (torchtitan's own test)."""
    return _get_available_device_type()

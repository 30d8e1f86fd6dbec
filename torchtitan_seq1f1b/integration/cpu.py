# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Let torchtitan train on a machine without an accelerator (gloo on CPU).

torchtitan (0.2.2 and 0.3) resolves its device once at import time and falls
back to "cuda" when none is found, and several modules copy that choice at
their own import; its memory monitor, timeout barrier and FSDP reduce op
assume a GPU too. Each adapter names the modules of its release that copy
the device; everything here is a no-op where an accelerator exists.
"""

import importlib
import logging
import os
import platform
import resource
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import FSDPModule

from torchtitan_seq1f1b._torch_compat.devices import available_device_type

# torchtitan logs to the root logger; importing its module here would import torchtitan.
logger = logging.getLogger()

__all__ = ["CPUDeviceModule", "enable_cpu_training"]


class CPUDeviceModule:
    """``torch.cpu`` plus the accelerator-module calls torchtitan makes.

    Memory statistics are the process's peak resident set size: CPU has no
    caching allocator whose active/reserved bytes could be read.
    """

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        # torch.cpu.current_device() returns the string "cpu", which
        # torch.distributed.barrier(device_ids=[...]) rejects.
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        # ru_maxrss is KiB on Linux.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """The peak RSS of a process cannot be reset; it stays the lifetime peak."""

    @staticmethod
    def empty_cache() -> None:
        """No caching allocator on CPU."""


def _sum_only_gradient_division(set_gradient_divide_factor):
    """FSDP divides with PREMUL_SUM reductions, which gloo rejects; ask for plain sums."""

    def wrapper(self: FSDPModule, factor: float) -> None:
        set_gradient_divide_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    wrapper._seq1f1b_cpu = True
    return wrapper


def enable_cpu_training(device_consumers: tuple[str, ...]) -> bool:
    """Point torchtitan at the CPU if no accelerator exists; returns whether it did.

    device_consumers: the torchtitan modules holding ``device_type`` /
    ``device_module`` (``torchtitan.tools.utils`` and those that copy them at
    import time).
    """
    if available_device_type() is not None:
        return False
    device_module = CPUDeviceModule()
    for name in device_consumers:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module
    if not getattr(FSDPModule.set_gradient_divide_factor, "_seq1f1b_cpu", False):
        FSDPModule.set_gradient_divide_factor = _sum_only_gradient_division(
            FSDPModule.set_gradient_divide_factor
        )
    logger.info(
        "torchtitan_seq1f1b: no accelerator found; running torchtitan on CPU with "
        "gloo (device, memory monitor, barrier and FSDP reduce op adapted)"
    )
    return True

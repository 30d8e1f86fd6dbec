# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a report says about the machine: library versions, the device, loaded modules."""

import platform
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

__all__ = ["device_facts", "loaded_packages", "versions"]

# Distributions whose versions matter to the checks, besides Python and torch.
DISTRIBUTIONS = ("triton", "numpy", "flash-attn", "flash-attn-4", "torchtitan")


def _installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def versions() -> dict[str, str | int | None]:
    """Python, torch, its CUDA and cuDNN, and :data:`DISTRIBUTIONS` (None: absent)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        **{name: _installed(name) for name in DISTRIBUTIONS},
    }


def device_facts(device: torch.device) -> dict:
    """The device's type and name, and the GPUs torch sees (their count, capability, memory)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts = {"type": device.type, "name": platform.processor() or platform.machine(), "gpus": gpus}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return facts


def loaded_packages() -> list[str]:
    """Top-level names of every module imported so far."""
    return sorted({name.partition(".")[0] for name in sys.modules})

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""FlashAttention-4 or -3 behind torch's own flash ops, where installed and the GPU runs it.

torch 2.12+ can re-register its flash ops (dense and varlen, forward and
backward) to FlashAttention-4 (the ``flash-attn-4`` package, sm90 and sm100)
or FlashAttention-3 (a build registering ``torch.ops.flash_attn_3``, sm90)
through :func:`torch.nn.attention.activate_flash_attention_impl`. Both align
causal attention of fewer queries than keys bottom-right, as FlashAttention 2
does (their masks offset every query row by ``seqlen_k - seqlen_q``), so the
``varlen`` backend runs them unchanged. Not on ROCm, and not on torch 2.11,
whose overrides refuse every varlen call: there ``varlen`` keeps torch's
FlashAttention 2 and says so once.
"""

import functools
import importlib
import logging

import torch
from torch.nn import attention as torch_attention

from torchtitan_seq1f1b._torch_compat.attention_ops import FLASH_IMPLS_RUN_VARLEN
from torchtitan_seq1f1b.attention.backend import KernelTarget

__all__ = ["NEWER_FLASH", "activate_newer_flash", "newer_flash_impl"]

logger = logging.getLogger(__name__)

NEWER_FLASH = (
    # (torch's name, the module torch imports for it, compute capability majors)
    ("FA4", "flash_attn.cute.interface", (9, 10)),
    ("FA3", "flash_attn_interface", (9,)),
)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install is not installed
        return False
    return True


def newer_flash_impl(target: KernelTarget) -> str | None:
    """The newest FlashAttention torch can route its flash ops to on ``target``, or None."""
    if target.capability is None or torch.version.hip is not None:
        return None
    registered = torch_attention.list_flash_attention_impls()
    for impl, module, majors in NEWER_FLASH:
        if impl in registered and target.capability[0] in majors and _importable(module):
            if FLASH_IMPLS_RUN_VARLEN:
                return impl
            _log_too_old(impl)
            return None
    return None


@functools.cache
def _log_too_old(impl: str) -> None:
    logger.info(
        f"{impl} is installed, but torch {torch.__version__}'s {impl} flash ops refuse "
        "varlen calls (needs torch >= 2.12): attention_backend 'varlen' runs torch's "
        "FlashAttention 2"
    )


def activate_newer_flash(target: KernelTarget) -> str | None:
    """Route torch's flash ops to :func:`newer_flash_impl` (once per process); returns it."""
    impl = newer_flash_impl(target)
    if impl is not None and torch_attention.current_flash_attention_impl() != impl:
        torch_attention.activate_flash_attention_impl(impl)
        logger.info(f"torch's flash attention ops run {impl} on {target}")
    return impl

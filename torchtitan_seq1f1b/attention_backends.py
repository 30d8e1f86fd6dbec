# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Causal attention kernels for a segment attending to its prefix.

Every backend computes the same function: queries of a segment of ``Lq``
tokens attend to ``Lk >= Lq`` keys whose last ``Lq`` positions are the
segment itself, with the causal mask aligned bottom-right (query t sees keys
``<= Lk - Lq + t``). Layouts are sequence-major:

    q: (batch, Lq, n_heads, head_dim)
    k, v: (batch, Lk, n_kv_heads, head_dim), n_heads % n_kv_heads == 0
    returns (batch, Lq, n_heads, head_dim)

k and v are usually batch-strided views of the K/V store's buffers; every
kernel here takes them as they are (no packing copy) and none saves an
(Lq, Lk) mask for backward.

Each backend also states what it needs to run (:meth:`unmet_requirements`),
so ``"auto"`` never picks a kernel that cannot run and a forced backend fails
at start-up naming what is missing.
"""

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan_seq1f1b.kernels.cpu_flash import lower_right_causal_attention_cpu
from torchtitan_seq1f1b.kernels.cuda_flash import lower_right_causal_attention_flash
from torchtitan_seq1f1b.kernels.cuda_mem_efficient import lower_right_causal_attention_cuda

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "FlashAttnBackend",
    "KernelTarget",
    "SDPABackend",
    "TorchFlashBackend",
    "check_backend",
    "raise_if_unmet",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelTarget:
    """Where attention runs: what a kernel's requirements are checked against."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int

    @classmethod
    def of(cls, q: torch.Tensor) -> "KernelTarget":
        return cls(q.device, q.dtype, q.shape[-1])

    @property
    def capability(self) -> tuple[int, int] | None:
        """CUDA compute capability (major, minor), None off CUDA."""
        if self.device.type != "cuda":
            return None
        return tuple(torch.cuda.get_device_capability(self.device))

    def __str__(self) -> str:
        where = self.device.type
        if self.capability is not None:
            where += f" sm{self.capability[0]}{self.capability[1]}"
        return f"{where}, {str(self.dtype).removeprefix('torch.')}, head_dim {self.head_dim}"


def _flash_kernel_requirements(target: KernelTarget) -> list[str]:
    """What FlashAttention 2 kernels (flash-attn's and torch's build) need."""
    if target.device.type != "cuda":
        return [f"a CUDA device (this runs on {target.device.type})"]
    unmet = []
    major, minor = target.capability
    if (major, minor) < (8, 0):
        unmet.append(f"compute capability >= 8.0 (Ampere or newer; found {major}.{minor})")
    if target.dtype not in _HALF_DTYPES:
        unmet.append(f"fp16 or bf16 activations (found {target.dtype})")
    if target.head_dim > 256 or target.head_dim % 8:
        # Other head dims are padded by the kernels' wrappers: a copy of the prefix.
        unmet.append(f"head_dim a multiple of 8 and <= 256 (found {target.head_dim})")
    return unmet


def _mem_efficient_requirements(target: KernelTarget) -> list[str]:
    """What torch's CUDA memory-efficient kernel needs (the mask-free exact path)."""
    if target.device.type != "cuda":
        return [f"a CUDA device (this runs on {target.device.type})"]
    unmet = []
    capability = target.capability
    if capability < (5, 0):
        unmet.append(f"compute capability >= 5.0 (found {capability[0]}.{capability[1]})")
    if target.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        unmet.append(f"fp16, bf16 or fp32 activations (found {target.dtype})")
    elif target.dtype == torch.bfloat16 and capability < (8, 0):
        unmet.append("compute capability >= 8.0 for bf16")
    alignment = 4 if target.dtype == torch.float32 else 8
    if target.head_dim % alignment:
        unmet.append(f"head_dim a multiple of {alignment} (found {target.head_dim})")
    return unmet


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} K/V heads"
        )


class AttentionBackend:
    """Bottom-right causal attention of q against k/v (see module docstring)."""

    name: str

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        """What this backend needs and ``target`` lacks; empty if it can run."""
        raise NotImplementedError

    def supports(self, q: torch.Tensor) -> bool:
        """Whether this backend can run on ``q``'s device, dtype and head_dim."""
        return not self.unmet_requirements(KernelTarget.of(q))

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        raise NotImplementedError


class SDPABackend(AttentionBackend):
    """The exact path: any device and dtype, float64 included.

    CPU: torch's CPU flash kernel with the mask rebuilt in backward. CUDA:
    the memory-efficient kernel with its built-in bottom-right mask where it
    runs (not float64), else SDPA with a dense bool mask. Equal lengths (the
    first segment, unsplit training) take SDPA's own causal path.
    """

    name = "sdpa"

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        return []

    def __call__(self, q, k, v, scale):
        _check_heads(q, k)
        q_len, k_len = q.shape[1], k.shape[1]
        if q.is_cuda and not _mem_efficient_requirements(KernelTarget.of(q)):
            return lower_right_causal_attention_cuda(q, k, v, scale)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        # SDPA's is_causal is top-left aligned when lengths differ: only safe
        # for q_len == k_len.
        if q_len == k_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif q.device.type == "cpu":
            out = lower_right_causal_attention_cpu(q, k, v, scale)
        else:
            # A plain bool tensor, not torch's CausalBias: that tensor subclass
            # cannot be created under selective activation checkpointing.
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(
                k_len - q_len
            )
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        return out.transpose(1, 2)


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 2's ``flash_attn_func`` (the ``flash`` extra).

    flash-attn >= 2.1 aligns ``causal=True`` bottom-right when the query and
    key lengths differ, runs GQA natively and takes batch-strided inputs, so
    the prefix views go in as they are.
    """

    name = "flash"
    module, function = "flash_attn", "flash_attn_func"

    def __init__(self, kernel: Callable | None = None):
        self._kernel = kernel

    @property
    def kernel(self) -> Callable:
        if self._kernel is None:
            self._kernel = getattr(importlib.import_module(self.module), self.function)
        return self._kernel

    @classmethod
    def installed(cls) -> bool:
        try:
            return hasattr(importlib.import_module(cls.module), cls.function)
        except ImportError:
            return False

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = _flash_kernel_requirements(target)
        if not unmet and self._kernel is None and not self.installed():
            unmet.append("flash-attn 2 installed (pip install 'torchtitan-seq1f1b[flash]')")
        return unmet

    def __call__(self, q, k, v, scale):
        _check_heads(q, k)
        return self.kernel(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=True)


class TorchFlashBackend(AttentionBackend):
    """torch's own FlashAttention 2 kernel (the one behind ``varlen_attn``)."""

    name = "varlen"

    def __init__(self, kernel: Callable = lower_right_causal_attention_flash):
        self.kernel = kernel

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        unmet = _flash_kernel_requirements(target)
        if target.capability in ((8, 6), (8, 9)) and target.head_dim > 192:
            unmet.append("head_dim <= 192 on sm86/sm89 (torch's flash backward)")
        return unmet

    def __call__(self, q, k, v, scale):
        _check_heads(q, k)
        return self.kernel(q, k, v, scale)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashAttnBackend,
    "varlen": TorchFlashBackend,
    "sdpa": SDPABackend,
}


@functools.lru_cache(maxsize=None)
def _auto_choice(target: KernelTarget) -> AttentionBackend:
    """The first backend, in ATTENTION_BACKENDS order, that runs on ``target``.

    Chosen once per target and process, and logged once with what ruled out
    each faster kernel.
    """
    skipped = []
    for cls in ATTENTION_BACKENDS.values():
        backend = cls()
        unmet = backend.unmet_requirements(target)
        if not unmet:
            because = f" ({'; '.join(skipped)})" if skipped else ""
            logger.info(f"attention_backend='auto' uses {backend.name!r} on {target}{because}")
            return backend
        skipped.append(f"{backend.name!r} needs {', '.join(unmet)}")
    raise AssertionError("the exact backend runs everywhere")


class _AutoBackend(AttentionBackend):
    """The fastest backend that can run the input (see :func:`_auto_choice`)."""

    name = "auto"

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        return []

    def __call__(self, q, k, v, scale):
        return _auto_choice(KernelTarget.of(q))(q, k, v, scale)


def resolve_backend(name: str) -> AttentionBackend:
    """Backend for an ``attention_backend`` option: "auto", "flash", "varlen" or "sdpa"."""
    if name == "auto":
        return _AutoBackend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend={name!r} is unknown; choose one of "
            f"{['auto', *ATTENTION_BACKENDS]}"
        )
    return ATTENTION_BACKENDS[name]()


def check_backend(name: str, target: KernelTarget) -> AttentionBackend:
    """The backend ``attention_backend=name`` selects on ``target``; raises a
    ValueError naming what is missing when a forced backend cannot run there."""
    backend = resolve_backend(name)
    if isinstance(backend, _AutoBackend):
        return _auto_choice(target)
    raise_if_unmet(backend, target)
    return backend


def raise_if_unmet(backend: AttentionBackend, target: KernelTarget) -> None:
    unmet = backend.unmet_requirements(target)
    if unmet:
        raise ValueError(
            f"attention_backend={backend.name!r} cannot run on {target}: it needs "
            f"{'; '.join(unmet)}. Use attention_backend='auto' (picks the fastest "
            "kernel that runs, down to the exact path) or 'sdpa' (exact, runs anywhere)"
        )

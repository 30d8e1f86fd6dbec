# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What every attention backend computes, and where it can run.

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

With packed documents (``documents``, a
:class:`~torchtitan_seq1f1b.documents.SegmentDocuments`), k and v hold the
positions ``[documents.key_start, documents.end)`` and each query sees only
the keys of its own document at or before it: per document, bottom-right
causal attention of its queries in the segment against its keys so far.
Varlen kernels get one call for all rows, dense kernels run once per
document (:mod:`~torchtitan_seq1f1b.attention.packing`).

Each backend also states what it needs to run (:meth:`unmet_requirements`),
so ``"auto"`` never picks a kernel that cannot run and a forced backend fails
at start-up naming what is missing.
"""

from dataclasses import dataclass

import torch

from torchtitan_seq1f1b.documents import SegmentDocuments

__all__ = [
    "AttentionBackend",
    "KernelTarget",
    "check_heads",
    "flash_kernel_requirements",
]

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


def flash_kernel_requirements(target: KernelTarget) -> list[str]:
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


def check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
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
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        documents: SegmentDocuments | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def runs_as_op(self) -> bool:
        """Whether compiled blocks can run this backend as the registered op
        (:mod:`~torchtitan_seq1f1b.attention.segment_op`): whether it has
        :meth:`forward` and :meth:`backward`, which the op calls instead of autograd."""
        return False

    def forward(self, q, k, v, scale: float, documents: SegmentDocuments | None):
        """Layouts as :meth:`__call__`; returns the output and the kernel's logsumexp
        (batch, n_heads, Lq), contiguous."""
        raise NotImplementedError

    def backward(self, grad, q, k, v, out, lse, scale: float, documents):
        """(dq, dk, dv) of :meth:`forward`'s output, dk/dv for all ``Lk`` keys."""
        raise NotImplementedError

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Which backend an ``attention_backend`` option selects, and "auto"'s choice."""

import functools
import logging

from torchtitan_seq1f1b.attention.backend import AttentionBackend, KernelTarget
from torchtitan_seq1f1b.attention.exact import SDPABackend
from torchtitan_seq1f1b.attention.flash_attn import FlashAttnBackend
from torchtitan_seq1f1b.attention.torch_varlen import TorchFlashBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "check_backend",
    "first_that_runs",
    "raise_if_unmet",
    "resolve_backend",
]

logger = logging.getLogger(__name__)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashAttnBackend,
    "varlen": TorchFlashBackend,
    "sdpa": SDPABackend,
}


def first_that_runs(backends, target: KernelTarget, option: str, log: logging.Logger):
    """An instance of the first of ``backends`` (classes with ``unmet_requirements``)
    that runs on ``target``, logged to ``log`` once with what ruled out each one before
    it; ``option`` is the option set to "auto". The last must run everywhere."""
    skipped = []
    for cls in backends:
        backend = cls()
        unmet = backend.unmet_requirements(target)
        if not unmet:
            because = f" ({'; '.join(skipped)})" if skipped else ""
            log.info(f"{option}='auto' uses {backend.name!r} on {target}{because}")
            return backend
        skipped.append(f"{backend.name!r} needs {', '.join(unmet)}")
    raise AssertionError("the exact backend runs everywhere")


@functools.lru_cache(maxsize=None)
def _auto_choice(target: KernelTarget) -> AttentionBackend:
    """The first backend, in ATTENTION_BACKENDS order, that runs on ``target``.

    Chosen once per target and process, and logged once with what ruled out
    each faster kernel.
    """
    return first_that_runs(ATTENTION_BACKENDS.values(), target, "attention_backend", logger)


class _AutoBackend(AttentionBackend):
    """The fastest backend that can run the input (see :func:`_auto_choice`)."""

    name = "auto"

    def unmet_requirements(self, target: KernelTarget) -> list[str]:
        return []

    def __call__(self, q, k, v, scale, documents=None):
        return _auto_choice(KernelTarget.of(q))(q, k, v, scale, documents)

    def runs_as_op(self) -> bool:
        # So does every backend it chooses from.
        return True

    def forward(self, q, k, v, scale, documents):
        return _auto_choice(KernelTarget.of(q)).forward(q, k, v, scale, documents)

    def backward(self, grad, q, k, v, out, lse, scale, documents):
        chosen = _auto_choice(KernelTarget.of(q))
        return chosen.backward(grad, q, k, v, out, lse, scale, documents)


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

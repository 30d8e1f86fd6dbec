# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's qwen3_5 debug configs with the shipped tokenizer's 2048 tokens.

At its 248320-token vocabulary the embedding and the LM head hold 127M of
``qwen35_debugmodel``'s 136M parameters, and its seed checkpoint, optimizer
and logits dominate a CPU job; the recall corpus uses 2048 token ids.

``python -m tests.integration.titan_0_3.smaller_vocab MODULE ARGS...`` runs
MODULE as ``__main__`` (under torchrun, the next launcher or torchtitan.train)
with ``qwen35_debugmodel`` and ``qwen35_debugmodel_moe`` of
``torchtitan.models.qwen3_5.config_registry`` returning the cut configs.
"""

import dataclasses
import functools
from collections.abc import Callable

from tests.launch import run_next_module

VOCAB = 2048
CONFIGS = ("qwen35_debugmodel", "qwen35_debugmodel_moe")


def change_qwen3_5_configs(change: Callable) -> None:
    """Make each of :data:`CONFIGS` return its job changed in place by ``change(job)``."""
    from torchtitan_seq1f1b.integration.titan_0_3.torchtitan_configs import import_registry

    registry = import_registry("qwen3_5", CONFIGS[0])
    for name in CONFIGS:
        original = getattr(registry, name)

        @functools.wraps(original)  # keeps __module__: the adapter lists the registry's own
        def changed(original=original):
            job = original()
            change(job)
            return job

        setattr(registry, name, changed)


def with_vocab(job, vocab: int = VOCAB) -> None:
    """The job's decoder (embedding, LM head) and loss cut to ``vocab`` tokens."""
    model = job.model_spec.model
    job.model_spec.model = dataclasses.replace(
        model,
        vocab_size=vocab,
        tok_embeddings=dataclasses.replace(model.tok_embeddings, num_embeddings=vocab),
        lm_head=dataclasses.replace(model.lm_head, out_features=vocab),
    )
    # The chunked loss wraps the cross entropy that needs the vocabulary's size.
    getattr(job.loss, "loss_fn", job.loss).global_vocab_size = vocab


if __name__ == "__main__":
    change_qwen3_5_configs(with_vocab)
    run_next_module()

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What torchtitan main changed that this adapter reads, told apart by what the tree has.

torchtitan main (past 0.3.0, still versioned 0.2.2) folded the batch
dimension: a pipeline microbatch is one packed row of
``training.num_tokens_per_microbatch_per_dp_rank`` tokens, tokens and
positions are ``[T]``, hidden states ``[T, D]``, Q/K/V ``[T, N, H]``, and
``parallelism.num_pp_microbatches`` counts the microbatches. torchtitan 0.3
has ``[B, L]`` rows: ``training.local_batch_size`` rows of
``training.seq_len`` tokens, cut into microbatches of
``parallelism.pipeline_parallel_microbatch_size`` rows. Everything else the
adapter reads is alike in both (docs/upstream.md, "torchtitan main").
"""

from torchtitan.config import ParallelismConfig, TrainingConfig

from torchtitan_seq1f1b.integration import MAIN, titan_release

__all__ = [
    "FOLDED",
    "SEQ_DIM",
    "microbatch_rows",
    "num_microbatches",
    "sequence_length",
    "sequence_option",
]

FOLDED = titan_release() == MAIN
# The sequence dim of tokens, labels, positions and stage activations.
SEQ_DIM = 0 if FOLDED else 1


def sequence_option() -> str:
    """The option holding the tokens a Seq1F1B schedule cuts into segments."""
    return (
        "training.num_tokens_per_microbatch_per_dp_rank" if FOLDED else "training.seq_len"
    )


def sequence_length(training: TrainingConfig) -> int:
    """Tokens per sequence a schedule cuts: a packed microbatch on main, a row on 0.3."""
    return training.num_tokens_per_microbatch_per_dp_rank if FOLDED else training.seq_len


def microbatch_rows(parallelism: ParallelismConfig) -> int:
    """Rows (sequences) per pipeline microbatch: one packed row on main."""
    return 1 if FOLDED else parallelism.pipeline_parallel_microbatch_size


def num_microbatches(training: TrainingConfig, parallelism: ParallelismConfig) -> int:
    """Pipeline microbatches per step (per gradient-accumulation step)."""
    if FOLDED:
        return parallelism.num_pp_microbatches
    return training.local_batch_size // parallelism.pipeline_parallel_microbatch_size

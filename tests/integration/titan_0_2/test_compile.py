# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch.compile under Seq1F1B in torchtitan 0.2.2, end to end on CPU with gloo.

``[compile] enable`` compiles every TransformerBlock (``fullgraph=True``) and
the loss. From the seed checkpoint, compiled Seq1F1B runs must match the
compiled non-pipelined run on losses and the step-1 grad_norm within 1e-4,
and recompile a bounded number of times however the plan cuts the sequence.
The split-backward schedules are refused (see test_torchtitan_config.py).
"""

from tests.harness import compiled_parallel_matches, compiled_run_matches


def test_compiled_seq1f1b_matches_compiled_unpipelined(run, compiled_unpipelined):
    """Seq1F1B on a balanced (uneven) plan under op-level selective checkpointing;
    InterleavedSeq1F1B runs compiled in the torchtitan 0.3 tests."""
    compiled_run_matches(
        run, compiled_unpipelined, 2,
        "--seq1f1b.partition", "balanced",
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
    )


def test_compiled_fsdp_pp_matches_compiled_fsdp(run):
    compiled_parallel_matches(run, ("--parallelism.data_parallel_shard_degree", "2"))

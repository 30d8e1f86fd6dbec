# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torch.compile under Seq1F1B in torchtitan 0.3, end to end on CPU with gloo.

``--compile.enable`` compiles every decoder block (``fullgraph=True``) and
the loss. From the seed checkpoint, on packed documents, compiled Seq1F1B
runs must match the compiled non-pipelined run on losses and the step-1
grad_norm within 1e-4, and recompile a bounded number of times however the
plan cuts the sequence. The split-backward schedules are refused (see
test_config.py).
"""

from tests.harness import compiled_parallel_matches, compiled_run_matches


def test_compiled_interleaved_matches_compiled_unpipelined(run, compiled_unpipelined):
    """InterleavedSeq1F1B (4 stages) under full checkpointing; Seq1F1B runs compiled in
    the torchtitan 0.2.2 tests and, with TP, below."""
    compiled_run_matches(
        run, compiled_unpipelined, 4,
        "--seq1f1b.schedule", "InterleavedSeq1F1B",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--seq1f1b.num_segments", "3",
        "activation_checkpoint:full",
    )


def test_compiled_tp_pp_matches_compiled_tp(run):
    compiled_parallel_matches(run, ("--parallelism.tensor_parallel_degree", "2"))

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

import pytest

from tests.harness import compiled_parallel_matches, compiled_run_matches


@pytest.mark.parametrize(
    "stages,args",
    [
        (2, ("--seq1f1b.partition", "balanced", "activation_checkpoint:selective")),
        (4, ("--seq1f1b.schedule", "InterleavedSeq1F1B",
             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
             "--seq1f1b.num_segments", "3", "activation_checkpoint:full")),
    ],
    ids=["Seq1F1B-balanced-selective_ac", "InterleavedSeq1F1B-full_ac"],
)
def test_compiled_seq1f1b_matches_compiled_unpipelined(run, compiled_unpipelined, stages, args):
    compiled_run_matches(run, compiled_unpipelined, stages, *args)


def test_compiled_tp_pp_matches_compiled_tp(run):
    compiled_parallel_matches(run, ("--parallelism.tensor_parallel_degree", "2"))

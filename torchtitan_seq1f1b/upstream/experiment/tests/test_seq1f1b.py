# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The seq1f1b experiment end to end: ``--module seq1f1b`` under torchrun, on CPU with gloo.

From one seed checkpoint, the per-step losses and the step-1 grad_norm of
Seq1F1B at PP=2 (2 microbatches x 4 segments of packed documents, each
document across segments) equal the non-pipelined run's within 1e-4 relative; a
bad ``seq1f1b`` option fails before training, naming the option. About a
minute on 2 CPU cores.
"""

import pytest

from torchtitan_seq1f1b.check.titan_runs import (
    RunFailed,
    TEST_ARGS,
    torchrun,
    unpipelined_args,
)

CONFIG = "seq1f1b:seq1f1b_debug"  # --module seq1f1b --config seq1f1b_debug
RTOL = 1e-4


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed")
    torchrun(
        folder,
        1,
        *TEST_ARGS,
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree",
        "1",
        config=CONFIG,
    )
    return folder / "checkpoint" / "step-0"


def train(folder, nproc, seed_checkpoint, *args):
    return torchrun(
        folder,
        nproc,
        *TEST_ARGS,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed_checkpoint),
        "--checkpoint.interval",
        "1000",
        *args,
        config=CONFIG,
    )


def test_pp2_seq1f1b_matches_unpipelined(tmp_path, seed_checkpoint):
    reference = train(tmp_path / "pp1", 1, seed_checkpoint, *unpipelined_args())
    seq1f1b = train(tmp_path / "pp2", 2, seed_checkpoint)
    assert "Using pipeline schedule Seq1F1B" in seq1f1b.output
    steps = sorted(reference.losses)
    assert len(steps) >= 3 and sorted(seq1f1b.losses) == steps
    for step in steps:
        assert seq1f1b.losses[step] == pytest.approx(
            reference.losses[step], rel=RTOL
        ), step
    assert seq1f1b.grad_norms[1] == pytest.approx(reference.grad_norms[1], rel=RTOL)


def test_bad_option_fails_naming_it(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(
            tmp_path, 2, *TEST_ARGS, "--seq1f1b.num_segments", "300", config=CONFIG
        )
    assert "seq1f1b.num_segments=300" in failure.value.output
    assert "Training starts" not in failure.value.output

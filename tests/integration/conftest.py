# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One seed checkpoint for every torchtitan job of the session.

The causal and the block-causal debug flavors have the same parameters, so
their runs start from the same weights too.
"""

import pytest

from tests.harness import TEST_ARGS, torchrun


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed")
    torchrun(
        folder, 1, *TEST_ARGS,
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree", "1",
        # The same weights every session (test_torchtitan.py's BF16_RTOL was
        # measured on them).
        "--debug.seed", "0",
    )
    return folder / "checkpoint" / "step-0"


@pytest.fixture(scope="session")
def run(seed_checkpoint, tmp_path_factory):
    """run(nproc, *args): a short training run from the seed checkpoint."""

    def start(nproc, *args, name="run", **options):
        return torchrun(
            tmp_path_factory.mktemp(name), nproc, *TEST_ARGS,
            "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(seed_checkpoint),
            "--checkpoint.interval", "1000",
            *args,
            **options,
        )

    return start

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan jobs: the tests of the installed release, one seed checkpoint for all.

``titan_0_2/`` tests the torchtitan 0.2.2 adapter and ``titan_0_3/`` the 0.3
one; only the installed release's directory is collected. Every job of the
session starts from the same seed checkpoint (on 0.2.2 the causal and the
block-causal debug flavors have the same parameters, so their runs start
from the same weights too).
"""

import pytest

from tests.harness import COMPILE_ARGS, TEST_ARGS, torchrun, unpipelined_args
from torchtitan_seq1f1b.check.titan_runs import titan_release
from torchtitan_seq1f1b.integration import MAIN

# The 0.3 adapter also runs torchtitan main.
RELEASE_DIRS = {"0.2": "titan_0_2", "0.3": "titan_0_3", MAIN: "titan_0_3"}
collect_ignore = [d for d in RELEASE_DIRS.values() if d != RELEASE_DIRS.get(titan_release())]


def pytest_collection_modifyitems(config, items):
    """On torchtitan main, skip the tests marked ``titan_0_3_only``, giving their reason."""
    if titan_release() != MAIN:
        return
    for item in items:
        marker = item.get_closest_marker("titan_0_3_only")
        if marker is not None:
            reason = f"not ported to torchtitan main: {marker.args[0]}"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed")
    torchrun(
        folder, 1, *TEST_ARGS,
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree", "1",
        # The same weights every session (titan_0_2/test_torchtitan.py's
        # BF16_RTOL was measured on them).
        "--debug.seed", "0",
    )
    return folder / "checkpoint" / "step-0"


@pytest.fixture(scope="session")
def run(seed_checkpoint, tmp_path_factory):
    """run(nproc, *args): a short training run from the seed checkpoint; it writes
    checkpoints (at its last step, and at every ``--checkpoint.interval``) only with
    ``saves=True``."""

    def start(nproc, *args, name="run", saves=False, **options):
        return torchrun(
            tmp_path_factory.mktemp(name), nproc, *TEST_ARGS,
            "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(seed_checkpoint),
            *(("--checkpoint.interval", "1000") if saves else ("--checkpoint.load_only",)),
            *args,
            **options,
        )

    return start


@pytest.fixture(scope="module")
def compiled_unpipelined(run):
    """The non-pipelined run with compiled blocks and loss (test_compile.py)."""
    return run(
        1, *unpipelined_args(), *COMPILE_ARGS, name="compiled_unpipelined"
    )

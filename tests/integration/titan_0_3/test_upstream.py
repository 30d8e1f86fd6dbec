# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The upstream patch against the installed torchtitan itself (0.3.0, or main): it applies,
the patched tree's experiment tests pass there, and with the hook unset torchtitan's
own 1F1B trains exactly as in the unpatched tree.

The installed torchtitan package is copied into ``tmp/src/torchtitan`` (the
0.3.0 wheel has no ``experiments/README.md``; tests/tools/test_upstream.py
covers that edit), the patch is generated and applied with git, and the
experiment's own tests run with ``tmp/src`` first on the path, so
``torchtitan`` is the patched copy.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torchtitan

from tests.harness import REPO
from torchtitan_seq1f1b.integration.titan_0_3 import pipeline
from torchtitan_seq1f1b.upstream.schedule_hook import (
    has_schedule_builder,
    HOOK_TEST,
    PIPELINE_PARALLEL,
)
from torchtitan_seq1f1b.upstream.tree import EXPERIMENT_DIR

# Prints where ``--module seq1f1b`` finds its config.
RESOLVE = (
    "from torchtitan.config import ConfigManager; import torchtitan.experiments.seq1f1b as e; "
    "config = ConfigManager().parse_args(['--module', 'seq1f1b', '--config', 'seq1f1b_debug']); "
    "print(type(config).__module__, e.__file__)"
)


def run(*command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-6000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """tmp/src: a git repository of the installed torchtitan with the patch applied."""
    src = tmp_path_factory.mktemp("upstream") / "src"
    shutil.copytree(
        Path(torchtitan.__file__).parent, src / "torchtitan",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    run("git", "init", "-q", cwd=src)
    patch = src.parent / "seq1f1b.patch"
    run(sys.executable, "-m", "torchtitan_seq1f1b.upstream",
        "--torchtitan-src", str(src), "--output", str(patch), cwd=REPO)
    run("git", "apply", "--check", str(patch), cwd=src)
    run("git", "apply", str(patch), cwd=src)
    return src


def patched_env(src: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(REPO)]))


def test_the_core_hook_comes_first_and_its_unit_test_passes(patched):
    patch = (patched.parent / "seq1f1b.patch").read_text()
    assert patch.startswith(f"diff --git a/{PIPELINE_PARALLEL} b/{PIPELINE_PARALLEL}\n")
    assert has_schedule_builder((patched / PIPELINE_PARALLEL).read_text())
    output = run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(patched / HOOK_TEST),
        cwd=patched.parent, env=patched_env(patched),
    )
    assert "3 passed" in output
    # The experiment pipelines through the hook there (the installed 0.3 has none).
    hooked = run(
        sys.executable, "-c",
        "import torchtitan.experiments.seq1f1b.pipeline as p; print(p._HAS_SCHEDULE_HOOK)",
        cwd=patched.parent, env=patched_env(patched),
    )
    assert hooked.split()[-1] == "True"
    assert pipeline._HAS_SCHEDULE_HOOK == has_schedule_builder(
        (Path(torchtitan.__file__).parent.parent / PIPELINE_PARALLEL).read_text()
    )


def test_with_the_hook_unset_torch_1f1b_trains_as_unpatched(run, patched):
    """torchtitan's own 1F1B at PP=2 (``seq1f1b.schedule none``: ``pipeline_llm`` without
    a builder) in the patched tree: the same losses and grad norms, bit for bit."""
    args = (2, "--seq1f1b.schedule", "none")
    unpatched = run(*args, name="unpatched_1f1b")
    hook_unset = run(*args, name="hook_unset_1f1b", extra_env=patched_env(patched))
    assert "Using pipeline schedule 1F1B" in hook_unset.output
    assert hook_unset.losses == unpatched.losses and len(unpatched.losses) >= 3
    assert hook_unset.grad_norms == unpatched.grad_norms


def test_the_patch_adds_the_experiment_and_registers_it(patched):
    assert (patched / EXPERIMENT_DIR / "README.md").is_file()
    init = (patched / "torchtitan" / "experiments" / "__init__.py").read_text()
    assert '"seq1f1b",' in init
    resolved = run(sys.executable, "-c", RESOLVE, cwd=patched.parent, env=patched_env(patched))
    module, file = resolved.split()[-2:]
    assert module == "torchtitan.experiments.seq1f1b.trainer"
    assert Path(file) == patched / EXPERIMENT_DIR / "__init__.py"


def test_the_patched_trees_experiment_tests_pass(patched):
    tests = patched / EXPERIMENT_DIR / "tests"
    output = run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
        cwd=patched.parent, env=patched_env(patched),
    )
    assert "2 passed" in output

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The patched tree passes torchtitan's pre-commit formatters, flake8, codespell and
pydoclint (opt-in): the core hook's two files and the experiment.

Needs the linters torchtitan's ``.pre-commit-config.yaml`` pins, in a venv of
their own, and a torchtitan tree holding ``.flake8`` (a git checkout, 0.3 or main):

    python -m venv /tmp/lintvenv && /tmp/lintvenv/bin/pip install ufmt==2.3.0 \\
        black==22.12.0 usort==1.0.5 flake8==6.1.0 flake8-bugbear==22.4.25 \\
        pep8-naming==0.12.1 torchfix flake8-pep585 flake8-new-union-types==0.4.1 \\
        codespell==2.4.1 pydoclint==0.3.8
    SEQ1F1B_LINT_VENV=/tmp/lintvenv SEQ1F1B_LINT_TREE=~/torchtitan \\
        python -m pytest tests/tools/test_upstream_lint.py

Skipped unless both variables are set. pydoclint 0.3.8 is the release of the commit
torchtitan's pre-commit pins; with ``--config=pyproject.toml``, which has no
``[tool.pydoclint]`` section, it checks numpy-style docstrings.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO
from torchtitan_seq1f1b.upstream.schedule_hook import HOOK_TEST, PIPELINE_PARALLEL
from torchtitan_seq1f1b.upstream.tree import EXPERIMENT_DIR

VENV = os.environ.get("SEQ1F1B_LINT_VENV")
TREE = os.environ.get("SEQ1F1B_LINT_TREE")
pytestmark = pytest.mark.skipif(
    not (VENV and TREE), reason="set SEQ1F1B_LINT_VENV and SEQ1F1B_LINT_TREE to lint"
)
# What the linters read from the tree's root.
CONFIG_FILES = (".flake8", "pyproject.toml")
# What the patch adds or changes: the core hook and the experiment.
LINTED = (PIPELINE_PARALLEL, HOOK_TEST, EXPERIMENT_DIR)


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """A copy of ``SEQ1F1B_LINT_TREE`` with the patch, formatted by ``--ufmt``, applied."""
    tree, src = Path(TREE).expanduser(), tmp_path_factory.mktemp("lint") / "src"
    shutil.copytree(
        tree / "torchtitan", src / "torchtitan", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in CONFIG_FILES:
        assert (tree / name).is_file(), f"{tree / name}: lint needs torchtitan's {name}"
        shutil.copy(tree / name, src / name)
    assert run("git", "init", "-q", cwd=src).returncode == 0
    patch = src.parent / "seq1f1b.patch"
    generated = run(
        sys.executable, "-m", "torchtitan_seq1f1b.upstream", "--torchtitan-src", str(src),
        "--output", str(patch), "--ufmt", str(Path(VENV) / "bin" / "ufmt"), cwd=REPO,
    )
    assert generated.returncode == 0, generated.stdout
    applied = run("git", "apply", str(patch), cwd=src)
    assert applied.returncode == 0, applied.stdout
    return src


def test_ufmt_finds_nothing_to_format(patched):
    checked = run(str(Path(VENV) / "bin" / "ufmt"), "check", *LINTED, cwd=patched)
    assert checked.returncode == 0, checked.stdout


def test_flake8_finds_nothing(patched):
    flake8 = str(Path(VENV) / "bin" / "flake8")
    checked = run(flake8, "--config=.flake8", *LINTED, cwd=patched)
    assert checked.returncode == 0, checked.stdout


def test_codespell_finds_nothing(patched):
    codespell = str(Path(VENV) / "bin" / "codespell")
    checked = run(codespell, "--toml", "pyproject.toml", *LINTED, cwd=patched)
    assert checked.returncode == 0, checked.stdout


def test_pydoclint_finds_nothing(patched):
    pydoclint = str(Path(VENV) / "bin" / "pydoclint")
    checked = run(pydoclint, "--config=pyproject.toml", *LINTED, cwd=patched)
    assert checked.returncode == 0, checked.stdout

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``.ci/versions.py``: a CI stack prints what it imports and fails unless it is what its name says."""

import subprocess
import sys

import torch

from tests.harness import REPO


def _versions(*expected: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / ".ci" / "versions.py"), *expected],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )


def test_the_named_versions_pass_and_are_printed():
    release = torch.__version__.split("+")[0]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    result = _versions(f"python={python}", f"torch={release}", "no_such_package=none")
    assert result.returncode == 0, result.stdout
    assert f"stack: python {python}." in result.stdout
    assert f"stack: torch {torch.__version__}\n" in result.stdout
    assert "stack: no_such_package none\n" in result.stdout


def test_another_version_fails_the_stack_naming_both():
    result = _versions("python=2.7", "torch=2.99.0", "pytest=none")
    assert result.returncode == 1
    assert "where this stack is named for python 2.7" in result.stdout
    assert f"torch {torch.__version__}, where this stack is named for torch 2.99.0" in result.stdout
    assert "where this stack is named for no pytest" in result.stdout

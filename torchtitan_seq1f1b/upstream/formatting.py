# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The experiment's Python files as torchtitan's pre-commit formats them.

torchtitan's ``.pre-commit-config.yaml`` runs ufmt (usort, then black at its
default 88 columns); the adapter modules the experiment is made of are
written at 100. With ``--ufmt PATH`` the generator runs that ufmt over the
files in a scratch copy laid out like the tree, so usort sorts ``torchtitan``
as first party and ``torchtitan_seq1f1b`` as third party, as it will in the
PR. torchtitan pins ufmt 2.3.0 with black 22.12.0 and usort 1.0.5.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from torchtitan_seq1f1b.upstream.tree import SourceTree, UpstreamError

__all__ = ["ufmt_format"]

# Formatter settings ([tool.black], [tool.usort]) live in the tree's pyproject.
CONFIG_FILES = ("pyproject.toml",)


def ufmt_format(files: dict[str, str], source: SourceTree, ufmt: str) -> dict[str, str]:
    """``files`` ({tree path: text}) with every ``.py`` text formatted by ``ufmt``.

    Other files pass through. Fails naming the command when ufmt does.
    """
    with tempfile.TemporaryDirectory(prefix="seq1f1b-ufmt-") as scratch:
        root = Path(scratch)
        for name in CONFIG_FILES:
            if source.exists(name):
                (root / name).write_text(source.read(name))
        python = {path: text for path, text in files.items() if path.endswith(".py")}
        for path, text in python.items():
            file = root / path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
        # usort finds the first-party package by walking up __init__.py files.
        for package in ("torchtitan", "torchtitan/experiments"):
            (root / package / "__init__.py").touch()
        # ufmt runs in the scratch copy: a relative path is the caller's.
        found = shutil.which(ufmt)
        command = [os.path.abspath(found) if found else ufmt, "format", *sorted(python)]
        try:
            result = subprocess.run(
                command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as error:
            raise UpstreamError(f"cannot run {ufmt!r} (--ufmt): {error}") from None
        if result.returncode != 0:
            raise UpstreamError(f"{ufmt} format failed ({result.returncode}):\n{result.stdout}")
        return {
            path: (root / path).read_text() if path in python else text
            for path, text in files.items()
        }

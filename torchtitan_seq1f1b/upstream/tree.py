# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The torchtitan source tree a patch is generated for."""

from pathlib import Path

__all__ = ["EXPERIMENT_DIR", "SourceTree", "UpstreamError"]

# Where the experiment goes, relative to the tree's root.
EXPERIMENT_DIR = "torchtitan/experiments/seq1f1b"


class UpstreamError(RuntimeError):
    """The source tree cannot take the patch; the message names the file and why."""


class SourceTree:
    """A directory holding ``torchtitan/`` (a git checkout, an unpacked sdist, a copied package).

    Paths are relative to ``root`` with ``/`` separators, as in the patch.
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not (self.root / "torchtitan" / "__init__.py").is_file():
            raise UpstreamError(
                f"{self.root} is not a torchtitan source tree: "
                f"{self.root / 'torchtitan' / '__init__.py'} does not exist "
                "(pass the directory that contains torchtitan/)"
            )
        if (self.root / EXPERIMENT_DIR).exists():
            raise UpstreamError(
                f"{self.root / EXPERIMENT_DIR} already exists; generate the patch "
                "against a tree without the seq1f1b experiment"
            )

    def read(self, path: str) -> str:
        """The text of ``path``; :class:`UpstreamError` naming it when it is missing."""
        file = self.root / path
        if not file.is_file():
            raise UpstreamError(f"{file} does not exist; is {self.root} a torchtitan 0.3.x tree?")
        return file.read_text()

    def exists(self, path: str) -> bool:
        return (self.root / path).is_file()

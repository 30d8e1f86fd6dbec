# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The patches: torchtitan's schedule hook, and the experiment's new files with the
registration edits, as git diffs."""

import difflib
from pathlib import Path

from torchtitan_seq1f1b.upstream.experiment_files import experiment_files
from torchtitan_seq1f1b.upstream.formatting import ufmt_format
from torchtitan_seq1f1b.upstream.registration import add_experiment_row, add_supported_experiment
from torchtitan_seq1f1b.upstream.schedule_hook import (
    add_schedule_builder,
    HOOK_TEST,
    hook_edits,
    PIPELINE_PARALLEL,
)
from torchtitan_seq1f1b.upstream.tree import SourceTree

__all__ = ["EXPERIMENTS_INIT", "EXPERIMENTS_README", "build_hook_patch", "build_patch", "file_diff"]

EXPERIMENTS_INIT = "torchtitan/experiments/__init__.py"
EXPERIMENTS_README = "torchtitan/experiments/README.md"
NO_NEWLINE = "\\ No newline at end of file\n"
HOOK_TEST_TEXT = Path(__file__).parent / "core" / Path(HOOK_TEST).name


def file_diff(path: str, old: str | None, new: str) -> str:
    """A ``git apply``-able diff of ``path`` from ``old`` (None: a new file) to ``new``."""
    diff = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile="/dev/null" if old is None else f"a/{path}",
        tofile=f"b/{path}",
    )
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    # difflib leaves a last line without its newline as is; git marks it.
    return header + "".join(
        line if line.endswith("\n") else line + "\n" + NO_NEWLINE for line in diff
    )


def build_hook_patch(source: SourceTree) -> str:
    """The core patch: ``pipeline_llm``'s schedule hook and its unit test
    (:mod:`.schedule_hook`, the test written as torchtitan's ufmt formats it); empty
    where ``source`` has the hook already."""
    edits = hook_edits(source)
    if not edits:
        return ""
    old = edits[PIPELINE_PARALLEL]
    new = add_schedule_builder(old, str(source.root / PIPELINE_PARALLEL))
    parts = [file_diff(PIPELINE_PARALLEL, old, new)]
    return "".join(parts + [file_diff(HOOK_TEST, None, HOOK_TEST_TEXT.read_text())])


def build_patch(source: SourceTree, ufmt: str | None = None) -> str:
    """Everything ``source`` needs for the seq1f1b experiment, in one patch: the core
    hook first (:func:`build_hook_patch`), then the experiment.

    The registration hunks are computed from ``source``'s own files;
    ``experiments/README.md`` gets its row only where the tree has one (the
    wheel does not ship it). With ``ufmt`` (a ufmt executable) the new Python
    files are formatted as torchtitan's pre-commit formats them.
    """
    edits = {EXPERIMENTS_INIT: add_supported_experiment}
    if source.exists(EXPERIMENTS_README):
        edits[EXPERIMENTS_README] = add_experiment_row
    parts = []
    for path, edit in edits.items():
        old = source.read(path)
        # Errors name the file as the user knows it.
        parts.append(file_diff(path, old, edit(old, str(source.root / path))))
    files = experiment_files()
    if ufmt is not None:
        files = ufmt_format(files, source, ufmt)
    parts += [file_diff(path, None, text) for path, text in files.items()]
    return build_hook_patch(source) + "".join(parts)

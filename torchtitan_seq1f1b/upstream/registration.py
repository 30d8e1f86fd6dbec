# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The two edits that register the experiment in torchtitan's existing files.

- :func:`add_supported_experiment`: "seq1f1b" joins ``_supported_experiments``
  in ``torchtitan/experiments/__init__.py``, so ``--module seq1f1b`` resolves
  to ``torchtitan.experiments.seq1f1b.config_registry``;
- :func:`add_experiment_row`: a row in the "Current experiments" table of
  ``torchtitan/experiments/README.md``.

Both take a file's text and return the edited text; the patch is the
difference, so it applies to exactly the tree it was computed from.
"""

import ast

from torchtitan_seq1f1b.upstream.tree import UpstreamError

__all__ = ["EXPERIMENT_NAME", "EXPERIMENT_ROW", "add_experiment_row", "add_supported_experiment"]

EXPERIMENT_NAME = "seq1f1b"
# The owner is a placeholder handle until the PR names a real one.
EXPERIMENT_ROW = (
    "| [seq1f1b](./seq1f1b/) | TBA | [@seq1f1b-owner](https://github.com/seq1f1b-owner) |"
)
TABLE_HEADING = "## Current experiments"


def _supported_list(tree: ast.Module) -> ast.List | None:
    """The list literal in ``_supported_experiments = frozenset([...])``, if any."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "_supported_experiments"
                for t in node.targets
            )
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "frozenset"
            and len(node.value.args) == 1
            and isinstance(node.value.args[0], ast.List)
        ):
            return node.value.args[0]
    return None


def add_supported_experiment(text: str, path: str) -> str:
    """``text`` (of ``path``) with "seq1f1b" as the last entry of ``_supported_experiments``.

    The entry gets its own line, indented like the last one; a missing
    trailing comma on the last entry is added.
    """
    listed = _supported_list(ast.parse(text, filename=path))
    if listed is None or not listed.elts:
        raise UpstreamError(
            f"{path}: no `_supported_experiments = frozenset([...])` with entries to add "
            f"{EXPERIMENT_NAME!r} to; torchtitan 0.3.x defines it there"
        )
    if any(isinstance(e, ast.Constant) and e.value == EXPERIMENT_NAME for e in listed.elts):
        raise UpstreamError(f"{path}: _supported_experiments already lists {EXPERIMENT_NAME!r}")
    last = listed.elts[-1]
    if last.end_lineno == listed.end_lineno:
        raise UpstreamError(
            f"{path}: _supported_experiments closes on the line of its last entry "
            f"(line {listed.end_lineno}); expected one entry per line"
        )
    lines = text.splitlines(keepends=True)
    last_line = lines[last.end_lineno - 1]
    rest = last_line[last.end_col_offset :]
    if not rest.lstrip().startswith(","):
        lines[last.end_lineno - 1] = last_line[: last.end_col_offset] + "," + rest
    entry = " " * last.col_offset + f'"{EXPERIMENT_NAME}",\n'
    # The closing bracket's line (ast lines are 1-based).
    lines.insert(listed.end_lineno - 1, entry)
    return "".join(lines)


def add_experiment_row(text: str, path: str) -> str:
    """``text`` (of ``path``) with :data:`EXPERIMENT_ROW` after the last row of the
    table under "## Current experiments"."""
    lines = text.splitlines(keepends=True)
    try:
        heading = next(i for i, line in enumerate(lines) if line.strip() == TABLE_HEADING)
    except StopIteration:
        raise UpstreamError(
            f"{path}: no {TABLE_HEADING!r} heading to add the seq1f1b row under"
        ) from None
    start = next((i for i in range(heading + 1, len(lines)) if lines[i].strip()), None)
    if start is None or not lines[start].lstrip().startswith("|"):
        raise UpstreamError(f"{path}: no table follows {TABLE_HEADING!r}")
    end = start
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    header_cells = lines[start].strip().strip("|").count("|") + 1
    row_cells = EXPERIMENT_ROW.strip("|").count("|") + 1
    if header_cells != row_cells or end - start < 2:
        raise UpstreamError(
            f"{path}: the {TABLE_HEADING!r} table has {header_cells} columns and "
            f"{end - start} lines; expected a header, a separator and {row_cells} columns"
        )
    if any(f"[{EXPERIMENT_NAME}]" in line for line in lines[start:end]):
        raise UpstreamError(f"{path}: the {TABLE_HEADING!r} table already has a seq1f1b row")
    if not lines[end - 1].endswith("\n"):
        lines[end - 1] += "\n"
    lines.insert(end, EXPERIMENT_ROW + "\n")
    return "".join(lines)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The files of ``torchtitan/experiments/seq1f1b/``.

- the torchtitan 0.3 adapter's modules
  (:mod:`torchtitan_seq1f1b.integration.titan_0_3`), with that package's name
  rewritten to ``torchtitan.experiments.seq1f1b`` (and ``--module
  torchtitan_seq1f1b`` in their docstrings to ``--module seq1f1b``);
  everything else stays imported from the package's two public modules:
  the runtime (``torchtitan_seq1f1b.__all__``) and the torchtitan toolkit
  (``torchtitan_seq1f1b.integration.__all__``), never from the submodule
  defining a name;
- the package's ``__init__`` also calls ``install()`` when imported:
  ``--module seq1f1b`` imports the package before its ``config_registry``,
  as ``--module torchtitan_seq1f1b`` imports ours, so the shipped corpus is
  registered (and the CPU selected without an accelerator) before the config
  is built;
- everything under ``experiment/`` next to this module (README, tests), as is.
"""

import ast
from importlib import import_module
from pathlib import Path

from torchtitan_seq1f1b.integration import TOOLKIT
from torchtitan_seq1f1b.upstream.tree import EXPERIMENT_DIR, UpstreamError

__all__ = ["ADAPTER_PACKAGE", "EXPERIMENT_PACKAGE", "experiment_files", "rewrite_module"]

# Read as files, not imported: the adapter imports torchtitan, the generator does not need it.
PACKAGE = "torchtitan_seq1f1b"
TOOLKIT_PACKAGE = f"{PACKAGE}.integration"
ADAPTER_PACKAGE = f"{TOOLKIT_PACKAGE}.titan_0_3"
ADAPTER_DIR = Path(__file__).parents[1].joinpath(*ADAPTER_PACKAGE.split(".")[1:])
EXPERIMENT_PACKAGE = EXPERIMENT_DIR.replace("/", ".")
TEMPLATES = Path(__file__).parent / "experiment"
RENAMES = {
    ADAPTER_PACKAGE: EXPERIMENT_PACKAGE,
    "--module torchtitan_seq1f1b": "--module seq1f1b",
}
INSTALL_ON_IMPORT = """

# ``--module seq1f1b`` imports this package before its config_registry.
install()
"""


def public_home(module: str, name: str) -> str | None:
    """The public module exporting ``module``'s ``name``: the runtime (``torchtitan_seq1f1b``)
    or the torchtitan toolkit (``torchtitan_seq1f1b.integration``); None if neither does."""
    package = import_module(PACKAGE)
    # The runtime's modules import no torchtitan, so comparing objects is safe there.
    if name in package.__all__ and getattr(package, name) is getattr(
        import_module(module), name, None
    ):
        return PACKAGE
    if TOOLKIT.get(name) == module:
        return TOOLKIT_PACKAGE
    return None


def public_imports(text: str, name: str = "<text>") -> str:
    """``text`` with each ``from torchtitan_seq1f1b.<module> import ...`` (at any depth)
    rewritten to import the same names from their public home (:func:`public_home`).

    Fails naming the file and the import if a name has none.
    """
    lines = text.splitlines(keepends=True)
    imports = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)]
    # Bottom up, so earlier statements keep their line numbers.
    for node in sorted(imports, key=lambda node: node.lineno, reverse=True):
        module = node.module or ""
        if node.level or not module.startswith(f"{PACKAGE}.") or module == TOOLKIT_PACKAGE:
            continue
        homes: dict[str, list[str]] = {}
        for alias in node.names:
            home = public_home(module, alias.name)
            if home is None:
                raise UpstreamError(
                    f"{name}:{node.lineno} imports {module}.{alias.name}, which no public "
                    f"module exports: add it to {PACKAGE}.__all__ (runtime) or to "
                    f"{TOOLKIT_PACKAGE}'s toolkit"
                )
            spelled = alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
            homes.setdefault(home, []).append(spelled)
        indent = " " * node.col_offset
        statements = [
            f"{indent}from {home} import {', '.join(names)}\n" for home, names in homes.items()
        ]
        lines[node.lineno - 1 : node.end_lineno] = statements
    return "".join(lines)


def rewrite_module(text: str, name: str) -> str:
    """An adapter module's ``text`` (file ``name``) as the experiment's.

    Fails naming the file and line if the adapter's package is still
    referred to after the rewrite (a relative or ``from ... import titan_0_3``
    form the rename does not cover).
    """
    for old, new in RENAMES.items():
        text = text.replace(old, new)
    text = public_imports(text, name)
    leftover = ADAPTER_PACKAGE.rsplit(".", 1)[-1]
    for number, line in enumerate(text.splitlines(), 1):
        if leftover in line:
            raise UpstreamError(
                f"{ADAPTER_DIR / name}:{number} still refers to {leftover!r} after "
                f"renaming {ADAPTER_PACKAGE} to {EXPERIMENT_PACKAGE}: {line.strip()!r}"
            )
    if name == "__init__.py":
        if "def install(" not in text:
            raise UpstreamError(
                f"{ADAPTER_DIR / name} defines no install() for the experiment to call"
            )
        text = text.rstrip("\n") + "\n" + INSTALL_ON_IMPORT
    return text


def experiment_files() -> dict[str, str]:
    """{path in the torchtitan tree: text} of every file the experiment adds."""
    files = {
        f"{EXPERIMENT_DIR}/{module.name}": rewrite_module(module.read_text(), module.name)
        for module in sorted(ADAPTER_DIR.glob("*.py"))
    }
    for template in sorted(p for p in TEMPLATES.rglob("*") if p.is_file()):
        if "__pycache__" in template.parts:
            continue
        path = template.relative_to(TEMPLATES).as_posix()
        files[f"{EXPERIMENT_DIR}/{path}"] = template.read_text()
    return files

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The upstream patch generator's edits and errors, on small trees written here.

The end-to-end check (patch a copy of torchtitan 0.3, run the experiment's
tests in it) is tests/integration/titan_0_3/test_upstream.py.
"""

import subprocess

import pytest

from torchtitan_seq1f1b.upstream.__main__ import main
from torchtitan_seq1f1b.upstream.experiment_files import experiment_files, rewrite_module
from torchtitan_seq1f1b.upstream.patch import file_diff
from torchtitan_seq1f1b.upstream.registration import (
    add_experiment_row,
    add_supported_experiment,
    EXPERIMENT_ROW,
)
from torchtitan_seq1f1b.upstream.tree import EXPERIMENT_DIR, SourceTree, UpstreamError

INIT = "torchtitan/experiments/__init__.py"
README = "torchtitan/experiments/README.md"

SUPPORTED = '''_supported_experiments = frozenset(
    [
        "graph_trainer.llama3",
        # a comment
        "rl"
    ]
)
'''

TABLE = """Intro.

## Current experiments

| Experiment | Test Status | Owners |
| ----- | ----: | ----: |
| [a](./a/) | TBA | [@x](https://github.com/x) |
| [b](./b/) | TBA | [@y](https://github.com/y) |

## Later section
"""


def test_seq1f1b_is_added_as_the_last_supported_experiment():
    assert add_supported_experiment(SUPPORTED, INIT) == SUPPORTED.replace(
        '        "rl"\n', '        "rl",\n        "seq1f1b",\n'
    )


def test_a_tree_without_supported_experiments_fails_naming_the_file(tmp_path, capsys):
    (tmp_path / "torchtitan" / "experiments").mkdir(parents=True)
    (tmp_path / "torchtitan" / "__init__.py").write_text("")
    (tmp_path / "torchtitan" / "experiments" / "__init__.py").write_text("EXPERIMENTS = []\n")
    assert main(["--torchtitan-src", str(tmp_path), "--output", str(tmp_path / "p.patch")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / INIT}: no `_supported_experiments = frozenset([...])`" in err
    assert not (tmp_path / "p.patch").exists()


def test_a_directory_without_torchtitan_is_refused(tmp_path):
    with pytest.raises(UpstreamError, match="not a torchtitan source tree"):
        SourceTree(tmp_path)


def test_an_already_listed_experiment_is_refused():
    with pytest.raises(UpstreamError, match="already lists 'seq1f1b'"):
        add_supported_experiment(add_supported_experiment(SUPPORTED, INIT), INIT)


def test_the_row_goes_after_the_last_row_of_the_table():
    assert add_experiment_row(TABLE, README) == TABLE.replace(
        "[@y](https://github.com/y) |\n", f"[@y](https://github.com/y) |\n{EXPERIMENT_ROW}\n"
    )


@pytest.mark.parametrize(
    "text,message",
    [
        ("# Experiments\n\nno table\n", "no '## Current experiments' heading"),
        ("## Current experiments\n\nNone yet.\n", "no table follows"),
        ("## Current experiments\n\n| A | B |\n| - | - |\n", "has 2 columns"),
    ],
)
def test_a_readme_without_the_table_fails_naming_the_file(text, message):
    with pytest.raises(UpstreamError, match=message) as error:
        add_experiment_row(text, README)
    assert str(error.value).startswith(README)


def test_diffs_apply_with_git_also_without_a_final_newline(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "old.txt").write_text("a\nb")
    patch = file_diff("old.txt", "a\nb", "a\nb\nc") + file_diff("new/x.txt", None, "x\ny")
    (tmp_path / "p.patch").write_text(patch)
    subprocess.run(["git", "apply", "p.patch"], cwd=tmp_path, check=True)
    assert (tmp_path / "old.txt").read_text() == "a\nb\nc"
    assert (tmp_path / "new" / "x.txt").read_text() == "x\ny"


def test_the_experiment_imports_itself_and_installs_on_import():
    files = experiment_files()
    modules = {path: text for path, text in files.items() if path.endswith(".py")}
    assert f"{EXPERIMENT_DIR}/config_registry.py" in modules
    assert f"{EXPERIMENT_DIR}/README.md" in files
    assert f"{EXPERIMENT_DIR}/tests/test_seq1f1b.py" in files
    for path, text in modules.items():
        assert "titan_0_3" not in text, path
    registry = modules[f"{EXPERIMENT_DIR}/config_registry.py"]
    assert "from torchtitan.experiments.seq1f1b.trainer import Seq1F1BTrainer" in registry
    assert "--module seq1f1b --config seq1f1b_debug" in registry
    assert modules[f"{EXPERIMENT_DIR}/__init__.py"].endswith("\ninstall()\n")


def test_a_reference_the_rename_misses_fails_naming_the_line():
    with pytest.raises(UpstreamError, match=r"pipeline.py:2 still refers to 'titan_0_3'"):
        rewrite_module(
            "import os\nfrom torchtitan_seq1f1b.integration import titan_0_3\n", "pipeline.py"
        )

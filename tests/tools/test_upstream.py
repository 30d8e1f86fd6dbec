# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The upstream patch generator's edits and errors, on small trees written here.

The end-to-end check (patch a copy of torchtitan 0.3, run the experiment's
tests in it) is tests/integration/titan_0_3/test_upstream.py.
"""

import ast
import subprocess
import sys

import pytest

import torchtitan_seq1f1b
from torchtitan_seq1f1b import integration
from torchtitan_seq1f1b.check import titan_runs
from torchtitan_seq1f1b.upstream.__main__ import main
from torchtitan_seq1f1b.upstream.experiment_files import (
    experiment_files,
    public_imports,
    rewrite_module,
)
from torchtitan_seq1f1b.upstream.formatting import ufmt_format
from torchtitan_seq1f1b.upstream.patch import file_diff
from torchtitan_seq1f1b.upstream.schedule_hook import (
    add_schedule_builder,
    has_schedule_builder,
    HOOK_TEST,
    PARAMETER_LINES,
    PIPELINE_PARALLEL,
)
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

PIPELINE = """import torch


def pipeline_llm(
    model,
    *,
    loss_fn: LossFunction,
) -> tuple:
    stages = split(model)
    pp_schedule = _build_pipeline_schedule(
        stages=stages,
    )
    return pp_schedule


def pipeline_vlm(model, **kwargs):
    pp_schedule = _build_pipeline_schedule(model)
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


def test_the_experiment_ships_torchtitans_integration_test_list():
    text = experiment_files()[f"{EXPERIMENT_DIR}/tests/integration_tests.py"]
    assert "from tests.integration_tests import OverrideDefinitions" in text
    assert "def build_seq1f1b_test_list() -> list[OverrideDefinitions]:" in text


# A stand-in ufmt: appends a marker to the files it is given, from the tree's layout.
FAKE_UFMT = """#!{python}
import pathlib, sys
assert sys.argv[1] == "format"
assert pathlib.Path("torchtitan/__init__.py").is_file()
assert pathlib.Path("pyproject.toml").read_text() == "[tool.black]\\n"
for name in sys.argv[2:]:
    if "bad" in name:
        sys.exit("cannot parse " + name)
    path = pathlib.Path(name)
    path.write_text(path.read_text() + "# formatted\\n")
"""


@pytest.fixture
def fake_ufmt(tmp_path):
    (tmp_path / "torchtitan").mkdir()
    (tmp_path / "torchtitan" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("[tool.black]\n")
    ufmt = tmp_path / "ufmt"
    ufmt.write_text(FAKE_UFMT.format(python=sys.executable))
    ufmt.chmod(0o755)
    return SourceTree(tmp_path), str(ufmt)


def test_ufmt_formats_the_python_files_in_the_trees_layout(fake_ufmt):
    source, ufmt = fake_ufmt
    files = {f"{EXPERIMENT_DIR}/a.py": "x = 1\n", f"{EXPERIMENT_DIR}/README.md": "# R\n"}
    assert ufmt_format(files, source, ufmt) == {
        f"{EXPERIMENT_DIR}/a.py": "x = 1\n# formatted\n",
        f"{EXPERIMENT_DIR}/README.md": "# R\n",
    }


def test_a_failing_ufmt_fails_naming_it(fake_ufmt):
    source, ufmt = fake_ufmt
    with pytest.raises(UpstreamError, match=r"ufmt format failed \(1\):\ncannot parse"):
        ufmt_format({f"{EXPERIMENT_DIR}/bad.py": "x = (\n"}, source, ufmt)
    with pytest.raises(UpstreamError, match=r"cannot run '/no/ufmt' \(--ufmt\)"):
        ufmt_format({f"{EXPERIMENT_DIR}/a.py": ""}, source, "/no/ufmt")


def test_names_are_imported_from_their_public_module():
    text = "from torchtitan_seq1f1b.schedules import (\n    ScheduleSeq1F1B,\n)\nx = 1\n"
    assert public_imports(text) == "from torchtitan_seq1f1b import ScheduleSeq1F1B\nx = 1\n"
    # A statement's names split between the runtime and the torchtitan toolkit.
    mixed = "from torchtitan_seq1f1b.attention import check_backend, wrap_attention as wrap\n"
    assert public_imports(mixed) == (
        "from torchtitan_seq1f1b.integration import check_backend\n"
        "from torchtitan_seq1f1b import wrap_attention as wrap\n"
    )


def test_a_name_no_public_module_exports_fails_the_patch():
    private = "from torchtitan_seq1f1b.attention.choice import resolve_backend\n"
    with pytest.raises(UpstreamError, match=r"a.py:1 imports .*resolve_backend, which no public"):
        public_imports(private, "a.py")


PUBLIC_MODULES = {
    "torchtitan_seq1f1b": torchtitan_seq1f1b.__all__,
    "torchtitan_seq1f1b.integration": integration.__all__,
}


def test_the_experiment_imports_only_public_names():
    """Its code imports the runtime's and the toolkit's ``__all__``; its tests may also use
    the torchtitan-run helpers' ``__all__``."""
    found = set()
    for path, text in experiment_files().items():
        if not path.endswith(".py"):
            continue
        public = PUBLIC_MODULES
        if "/tests/" in path:
            public = {**public, titan_runs.__name__: titan_runs.__all__}
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                assert not [a for a in node.names if a.name.startswith("torchtitan_seq1f1b")]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torchtitan_seq1f1b"
            ):
                assert node.module in public, (path, node.module)
                for alias in node.names:
                    assert alias.name in public[node.module], (path, node.module, alias.name)
                    found.add(node.module)
    assert found == {*PUBLIC_MODULES, titan_runs.__name__}


def test_the_hook_is_one_parameter_and_the_call_it_makes():
    hooked = add_schedule_builder(PIPELINE, PIPELINE_PARALLEL)
    signature, _, rest = PIPELINE.partition("    loss_fn: LossFunction,\n")
    body, _, vlm = rest.partition("def pipeline_vlm")
    assert hooked == (
        signature + "    loss_fn: LossFunction,\n" + PARAMETER_LINES
        + body.replace("= _build_pipeline_schedule(", "= (schedule_builder or _build_pipeline_schedule)(")
        + "def pipeline_vlm" + vlm
    )
    assert has_schedule_builder(hooked) and not has_schedule_builder(PIPELINE)


@pytest.mark.parametrize(
    "text,message",
    [
        ("x = 1\n", "no `def pipeline_llm\\(`"),
        (PIPELINE.replace("    loss_fn: LossFunction,\n", ""), "0 of 'loss_fn: LossFunction,'"),
        (PIPELINE.replace("pp_schedule = _build_pipeline_schedule(\n", "pp_schedule = x(\n"),
         "0 of 'pp_schedule = _build_pipeline_schedule\\('"),
    ],
)
def test_a_pipeline_llm_without_its_anchors_fails_naming_the_file(text, message):
    with pytest.raises(UpstreamError, match=message) as error:
        add_schedule_builder(text, PIPELINE_PARALLEL)
    assert str(error.value).startswith(PIPELINE_PARALLEL)


def test_hook_only_writes_the_core_patch_once(tmp_path, capsys):
    (tmp_path / "torchtitan" / "distributed").mkdir(parents=True)
    (tmp_path / "torchtitan" / "__init__.py").write_text("")
    (tmp_path / PIPELINE_PARALLEL).write_text(PIPELINE)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    patch = tmp_path / "hook.patch"
    assert main(["--torchtitan-src", str(tmp_path), "--output", str(patch), "--hook-only"]) == 0
    text = patch.read_text()
    assert [line.split()[-1] for line in text.splitlines() if line.startswith("diff --git")] == [
        f"b/{PIPELINE_PARALLEL}", f"b/{HOOK_TEST}",
    ]
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    assert has_schedule_builder((tmp_path / PIPELINE_PARALLEL).read_text())
    assert main(["--torchtitan-src", str(tmp_path), "--output", str(patch), "--hook-only"]) == 1
    assert "has the schedule hook already" in capsys.readouterr().err

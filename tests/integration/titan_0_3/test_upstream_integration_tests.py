# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The experiment's GPU test list (``tests/integration_tests.py`` of the patch) is well formed.

torchtitan runs that list with its own ``tests.integration_tests`` runner,
which the wheel does not ship; a stand-in ``OverrideDefinitions`` (the
fields torchtitan 0.3's list entries use) lets the list be built here, and
every run's flags are parsed by torchtitan's ``ConfigManager`` against the
same config under its package name, ``--module torchtitan_seq1f1b``.
"""

import runpy
import shlex
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

import torchtitan_seq1f1b.upstream as upstream

DEFINITIONS = Path(upstream.__file__).parent / "experiment" / "tests" / "integration_tests.py"


@dataclass
class OverrideDefinitions:
    override_args: list[list[str]]
    test_descr: str = "default"
    test_name: str = "default"
    ngpu: int = 4
    disabled: bool = False


@pytest.fixture
def test_list(monkeypatch) -> list[OverrideDefinitions]:
    package = types.ModuleType("tests.integration_tests")
    package.OverrideDefinitions = OverrideDefinitions
    runner = types.ModuleType("tests.integration_tests.run_tests")
    runner.run_tests = lambda args, test_list: None
    monkeypatch.setitem(sys.modules, "tests.integration_tests", package)
    monkeypatch.setitem(sys.modules, "tests.integration_tests.run_tests", runner)
    return runpy.run_path(str(DEFINITIONS))["build_seq1f1b_test_list"]()


def test_every_run_is_the_experiments_config_and_its_flags_parse(test_list):
    names = [flavor.test_name for flavor in test_list]
    assert len(set(names)) == len(names) >= 4
    for flavor in test_list:
        assert flavor.ngpu in (2, 4, 8), flavor.test_name
        for run in flavor.override_args:
            argv = [word for arg in run for word in shlex.split(arg)]
            assert argv[:4] == ["--module", "seq1f1b", "--config", "seq1f1b_debug"]
            config = ConfigManager().parse_args(["--module", "torchtitan_seq1f1b", *argv[2:]])
            pp = config.parallelism.pipeline_parallel_degree
            tp = config.parallelism.tensor_parallel_degree
            dp = max(config.parallelism.data_parallel_shard_degree, 1)
            assert pp * tp * dp == flavor.ngpu, (flavor.test_name, run)

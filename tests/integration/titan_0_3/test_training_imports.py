# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan 0.3 process that loads the debug config loads the runtime and its adapter, nothing else."""

import json
import subprocess
import sys

from tests.harness import NOT_FOR_TRAINING as TOOLS


def test_config_registry_loads_no_tool_module():
    code = (
        "import json, sys\n"
        "import torchtitan.train\n"
        "from torchtitan.config import ConfigManager\n"
        "ConfigManager().parse_args(['--module', 'torchtitan_seq1f1b', '--config', 'seq1f1b_debug'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    modules = json.loads(out.stdout.splitlines()[-1])
    assert "torchtitan_seq1f1b.integration.titan_0_3.pipeline" in modules
    assert "torchtitan_seq1f1b.integration.titan_0_2" not in modules
    loaded_tools = [m for m in modules if m.split(".")[0] == "matplotlib" or m.startswith(TOOLS)]
    assert loaded_tools == []

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan process that imports the plugin loads the runtime and its adapter, nothing else."""

import json
import subprocess
import sys

from tests.harness import NOT_FOR_TRAINING as TOOLS


def _modules_after_plugin_import() -> list[str]:
    code = (
        "import json, sys\n"
        "import torchtitan.train\n"
        "import torchtitan_seq1f1b\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_training_process_loads_no_tool_module():
    modules = _modules_after_plugin_import()
    # The adapter is installed, so the import was a real torchtitan one.
    assert "torchtitan_seq1f1b.integration.titan_0_2.pipeline" in modules
    loaded_tools = [m for m in modules if m.split(".")[0] == "matplotlib" or m.startswith(TOOLS)]
    assert loaded_tools == []

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``install()`` leaves torchtitan's device alone where an accelerator exists.

Importing the package inside a torchtitan process calls
:func:`torchtitan_seq1f1b.integration.install`; its CPU shim
(:mod:`torchtitan_seq1f1b.integration.cpu`) may repoint torchtitan at the CPU
only when torch finds no accelerator. Each case runs in a fresh interpreter:
torchtitan resolves its device once, at import, so the report of an
accelerator has to precede that import, and the shim's edits are module state.
"""

import functools
import json
import subprocess
import sys

import pytest

from tests.harness import REPO

# Prints what the shim could touch, before and after the package's import.
PROBE = """
import json, sys
import torch
if sys.argv[1] == "accelerator":
    # What torch reports on a CUDA machine; this one has none to initialise.
    torch.cuda.is_available = lambda: True
from importlib import import_module
from torch.distributed.fsdp import FSDPModule
from torchtitan_seq1f1b.integration import ADAPTERS, titan_release

consumers = import_module(ADAPTERS[titan_release()]).DEVICE_CONSUMERS
def snapshot():
    modules = {
        name: {attr: id(value) for attr, value in vars(module).items()}
        for name, module in sys.modules.items()
        if name == "torchtitan" or name.startswith("torchtitan.")
    }
    modules["FSDPModule"] = {a: id(v) for a, v in vars(FSDPModule).items()}
    return modules
def shim_state():
    modules = {}
    for name in consumers:
        module = vars(import_module(name))
        modules[name] = {
            attr: module[attr] if attr == "device_type" else type(module[attr]).__name__
            for attr in ("device_type", "device_module")
            if attr in module
        }
    sum_only = hasattr(FSDPModule.set_gradient_divide_factor, "_seq1f1b_cpu")
    return {"modules": modules, "fsdp_sum_only": sum_only}
for name in consumers:
    import_module(name)
before, shim_before = snapshot(), shim_state()
import torchtitan_seq1f1b
from torchtitan_seq1f1b.integration import install
install()  # a second call, as a second import of the package would make
after = snapshot()
rebound = sorted(
    f"{name}.{attr}"
    for name, attrs in before.items()
    for attr, ident in attrs.items()
    if after[name].get(attr) != ident
)
print(json.dumps({"before": shim_before, "after": shim_state(), "rebound": rebound}))
"""


@functools.cache  # each case's interpreter once: both accelerator tests read one
def probe(case: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, case],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_with_an_accelerator_the_cpu_shim_touches_nothing():
    state = probe("accelerator")
    assert state["after"] == state["before"]
    for name, attrs in state["after"]["modules"].items():
        assert attrs.get("device_type", "cuda") == "cuda", name
        assert attrs.get("device_module", "module") == "module", name
    assert state["after"]["fsdp_sum_only"] is False
    # Nothing the shim owns was rebound in any torchtitan module or in FSDPModule.
    shim_names = {"device_type", "device_module", "set_gradient_divide_factor"}
    assert not [r for r in state["rebound"] if r.rsplit(".", 1)[-1] in shim_names]


def test_with_an_accelerator_install_rebinds_nothing_in_torchtitan_0_3():
    from torchtitan_seq1f1b.integration import MAIN, titan_release

    if titan_release() not in ("0.3", MAIN):
        pytest.skip("the torchtitan 0.2.2 adapter installs train-spec and trainer hooks")
    assert probe("accelerator")["rebound"] == []


def test_without_an_accelerator_the_cpu_shim_applies():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has an accelerator")
    state = probe("none")
    assert state["before"]["fsdp_sum_only"] is False
    assert state["after"]["fsdp_sum_only"] is True
    for name, attrs in state["after"]["modules"].items():
        # Each consumer holds what it had, now the CPU's.
        assert attrs.keys() == state["before"]["modules"][name].keys(), name
        assert attrs.get("device_type", "cpu") == "cpu", name
        assert attrs.get("device_module", "CPUDeviceModule") == "CPUDeviceModule", name
    assert any(attrs for attrs in state["after"]["modules"].values())


def test_torchtitan_main_is_told_apart_and_gets_the_0_3_adapter(monkeypatch):
    """main still calls itself 0.2.2: its Grain data package tells it apart, and install()
    runs the 0.3 adapter, which reads main's changes by what the tree has."""
    from torchtitan_seq1f1b import integration

    release = integration.titan_release()
    assert release in integration.ADAPTERS
    real = integration.find_spec
    monkeypatch.setattr(
        integration, "find_spec",
        lambda name: object() if name == integration.MAIN_ONLY_MODULE else real(name),
    )
    assert integration.titan_release() == integration.MAIN
    assert integration.ADAPTERS[integration.MAIN] == integration.ADAPTERS["0.3"]
    if release == "0.3":  # the 0.3 adapter's imports need a tree past 0.2.2
        integration.install()

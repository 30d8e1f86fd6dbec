# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""FlashAttention-4/3 behind torch's flash ops: chosen only where installed and runnable."""

import pytest
import torch

from torchtitan_seq1f1b.attention import KernelTarget
from torchtitan_seq1f1b.attention import newer_flash

CUDA = KernelTarget(torch.device("cuda"), torch.bfloat16, 128)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the capability set in ``gpu["capability"]`` with the modules in
    ``gpu["installed"]``, under a torch whose FA4/FA3 overrides run varlen (2.12+)."""
    state = {"capability": (9, 0), "installed": set(), "activated": [], "hip": None}
    monkeypatch.setattr(newer_flash, "FLASH_IMPLS_RUN_VARLEN", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(newer_flash, "_importable", lambda module: module in state["installed"])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(
        newer_flash.torch_attention, "activate_flash_attention_impl", state["activated"].append
    )
    monkeypatch.setattr(newer_flash.torch_attention, "current_flash_attention_impl", lambda: None)
    return state


@pytest.mark.parametrize(
    "capability,installed,expected",
    [
        ((9, 0), {"flash_attn.cute.interface", "flash_attn_interface"}, "FA4"),
        ((10, 0), {"flash_attn.cute.interface"}, "FA4"),
        ((9, 0), {"flash_attn_interface"}, "FA3"),
        ((10, 0), {"flash_attn_interface"}, None),  # FA3 is Hopper's
        ((8, 0), {"flash_attn.cute.interface", "flash_attn_interface"}, None),
        ((12, 0), {"flash_attn.cute.interface"}, None),
        ((9, 0), set(), None),
    ],
)
def test_the_newest_installed_kernel_the_gpu_runs(gpu, capability, installed, expected):
    gpu["capability"], gpu["installed"] = capability, installed
    assert newer_flash.newer_flash_impl(CUDA) == expected
    assert newer_flash.activate_newer_flash(CUDA) == expected
    assert gpu["activated"] == ([expected] if expected else [])


def test_torch_2_11_keeps_flash_attention_2_and_says_so(gpu, monkeypatch, caplog):
    """torch 2.11's FA4/FA3 overrides refuse varlen calls: installed or not, none is routed."""
    gpu["installed"] = {"flash_attn.cute.interface", "flash_attn_interface"}
    monkeypatch.setattr(newer_flash, "FLASH_IMPLS_RUN_VARLEN", False)
    with caplog.at_level("INFO", logger=newer_flash.__name__):
        assert newer_flash.activate_newer_flash(CUDA) is None
    assert gpu["activated"] == []
    assert "FA4 is installed" in caplog.text and "torch >= 2.12" in caplog.text


def test_never_on_rocm_or_off_cuda(gpu, monkeypatch):
    gpu["installed"] = {"flash_attn.cute.interface"}
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert newer_flash.newer_flash_impl(CUDA) is None
    cpu = KernelTarget(torch.device("cpu"), torch.bfloat16, 128)
    assert newer_flash.newer_flash_impl(cpu) is None


def test_torch_knows_both_names():
    registered = torch.nn.attention.list_flash_attention_impls()
    assert {impl for impl, _, _ in newer_flash.NEWER_FLASH} <= set(registered)

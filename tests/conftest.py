# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The stack under test in the report header; on a machine with CUDA, a
``gpu``-marked test that skips fails instead; planner calibrations go to a
temporary cache.

The GPU tests skip where CUDA (or the kernel they test) is missing; on a GPU
machine a silent skip would report success for kernels that never ran. A
skip whose reason starts with ``HARDWARE_SKIP`` (the GPU itself cannot run the
kernel, e.g. FlashAttention 2 on a pre-Ampere card) stays a skip.
"""

import pytest
import torch

from torchtitan_seq1f1b.check.titan_runs import titan_release

HARDWARE_SKIP = "hardware:"

# The shipped corpus's tests read it through torchtitan 0.2.2's data path; on
# torchtitan 0.3 the corpus is what titan_0_3's training runs train on.
collect_ignore = [] if titan_release() == "0.2" else ["data"]


def pytest_report_header(config) -> str:
    """Which stack runs: tests/integration/ collects only its torchtitan's tests."""
    return f"stack: torch {torch.__version__}, torchtitan {titan_release()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") and torch.cuda.is_available():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        if str(reason).removeprefix("Skipped: ").startswith(HARDWARE_SKIP):
            return
        report.outcome = "failed"
        report.longrepr = f"gpu test skipped on a machine with CUDA: {reason}"


# The smoke subset (``-m smoke``) for a torch that gets no full run (2.11, 2.12, 2.14): per test
# file, the parametrisations that run. It covers the pp=2 diagonal and slices the
# float64 grid files run off the main stack (every checkpointing mode on uneven plans,
# each variant), packed documents, eval, pre-split inputs and torch's own 1F1B order.
SMOKE = {
    "tests/schedules/test_exactness.py": ("[pp2-",),
    "tests/schedules/test_variants_exactness.py": ("-pp2]",),
    "tests/schedules/test_documents_exactness.py": ("[Seq1F1B-",),
    "tests/schedules/test_presplit_inputs.py": ("",),
    "tests/orders/test_orders.py": ("test_one_segment_is_torch_1f1b",),
    "tests/planner/test_planner.py": ("test_calibration",),
}


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    """Planner calibrations of the tests go to a fresh directory, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SEQ1F1B_CALIBRATION_CACHE", str(tmp_path_factory.mktemp("calibration")))
        yield


# CI runs these on the main stack (torchtitan 0.2.2, torch 2.13) only; its torch 2.15
# stack deselects them (``-m "not main_stack_only"``). Per path prefix, the node ids:
# arithmetic torch does not run (segment plans, the simulator, the tools); attention
# numerics on the exact path and the kernels' CPU stand-ins; context parallelism's core
# (torchtitan 0.3 runs it end to end); the check command (its gloo pipeline stays) and
# the GPU report (which the torch 2.11 stack rehearses); bf16 error bounds; the pp=4 twins
# of the float64 grids and the order grids validated through torch's lowering (both stacks
# run them at pp=2 and torch's own orders); the compiled float64 grid (torch 2.15 compiles
# torchtitan 0.3 jobs and the attention op); GatedDeltaNet's layer and schedule grids
# (torch 2.15 runs it in torchtitan 0.3's qwen3_5 jobs and float64 layer tests). The torch 2.15 stack keeps what torch
# releases change: the pipelining runtime, compile, checkpointing, pre-split inputs.
# test_documented_commands.py marks its commands that are not torchtitan 0.3 jobs.
MAIN_STACK_ONLY = {
    "tests/tools/": ("",),
    "tests/segmenting/": ("",),
    "tests/test_ci_versions.py": ("",),
    "tests/context_parallel/": ("",),
    "tests/attention/": (
        "test_kernels.py", "test_segment_aware.py", "test_document_attention.py",
        "test_kernel_pipelines.py", "test_newer_flash.py",
    ),
    "tests/check/test_check.py": (
        "test_cpu_check_", "test_without_cuda", "test_stack_check_", "test_kernel_",
        "test_gpu_tests_", "test_perf_",
    ),
    "tests/check/test_gpu_report.py": ("",),
    "tests/schedules/test_bf16.py": ("",),
    "tests/schedules/test_compiled_exactness.py": ("",),
    "tests/orders/test_orders.py": ("test_every_",),
    "tests/schedules/test_exactness.py": ("[pp4-",),
    "tests/schedules/test_variants_exactness.py": ("-pp4]",),
    "tests/linear_attention/": ("",),
    "tests/schedules/test_linear_attention_exactness.py": ("",),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        if any(part in item.nodeid for part in SMOKE.get(path, ())):
            item.add_marker(pytest.mark.smoke)
        if any(
            path.startswith(prefix) and any(part in item.nodeid for part in parts)
            for prefix, parts in MAIN_STACK_ONLY.items()
        ):
            item.add_marker(pytest.mark.main_stack_only)

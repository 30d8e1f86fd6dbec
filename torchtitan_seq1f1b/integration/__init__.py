# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan glue: one adapter per torchtitan release, sharing the ``[seq1f1b]`` options.

This package's ``__all__`` is the toolkit an adapter builds on, with the
runtime's own ``torchtitan_seq1f1b.__all__``: the adapters here and the
upstream experiment (docs/upstream.md) import nothing else of the package.

- :mod:`.options`: the ``[seq1f1b]`` options, one dataclass for every adapter;
- :mod:`.schedules`: the Seq1F1B schedule names a job selects;
- :mod:`.context_parallel`: torchtitan's CP handed to a Seq1F1B schedule;
- :mod:`.segment_plan`: the segment plan the options ask for;
- :mod:`.document_masks`: torchtitan's ``attention_masks`` as document ids;
- :mod:`.metrics`, :mod:`.summary`: the figures a job logs and its closing lines;
- :mod:`.cpu`: torchtitan on a machine without an accelerator;
- :mod:`.titan_0_2`: the torchtitan 0.2.2 adapter (TOML configs,
  ``custom_config_module``, train-spec and trainer hooks);
- :mod:`.titan_0_3`: the torchtitan 0.3 adapter (config registry, Trainer
  subclass, keyword-only pipelining function), which also runs torchtitan main.

The package's ``__init__`` calls :func:`install` when it is imported inside a
torchtitan process; nothing here imports torchtitan before that.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

import torch

from torchtitan_seq1f1b._torch_compat import TORCH_RELEASE

# The toolkit, each name from the module defining it; loaded on first use, since
# some modules import torchtitan and this package must import without it.
TOOLKIT = {
    "KernelTarget": "torchtitan_seq1f1b.attention",
    "SegmentAwareLayer": "torchtitan_seq1f1b.attention",
    "attention_forward_ops": "torchtitan_seq1f1b.attention",
    "check_backend": "torchtitan_seq1f1b.attention",
    "DATASET_NAMES": "torchtitan_seq1f1b.data",
    "RecallSpec": "torchtitan_seq1f1b.data",
    "TOKENIZER_DIR": "torchtitan_seq1f1b.data",
    "register_datasets": "torchtitan_seq1f1b.data",
    "RecallSource": "torchtitan_seq1f1b.data.grain_source",
    "recall_dataset": "torchtitan_seq1f1b.data.grain_source",
    "shared_problems": "torchtitan_seq1f1b.integration.config_problems",
    "context_group": "torchtitan_seq1f1b.integration.context_parallel",
    "context_parallel_problems": "torchtitan_seq1f1b.integration.context_parallel",
    "whole_sequences": "torchtitan_seq1f1b.integration.context_parallel",
    "enable_cpu_training": "torchtitan_seq1f1b.integration.cpu",
    "MASKS_KWARG": "torchtitan_seq1f1b.integration.document_masks",
    "bind_masks_as_documents": "torchtitan_seq1f1b.integration.document_masks",
    "is_inner_attention": "torchtitan_seq1f1b.integration.document_masks",
    "Seq1F1BFigures": "torchtitan_seq1f1b.integration.metrics",
    "KERNEL_TILE": "torchtitan_seq1f1b.integration.options",
    "Seq1F1BOptions": "torchtitan_seq1f1b.integration.options",
    "SCHEDULES": "torchtitan_seq1f1b.integration.schedules",
    "SPLIT_BACKWARD_SCHEDULES": "torchtitan_seq1f1b.integration.schedules",
    "ScheduleEntry": "torchtitan_seq1f1b.integration.schedules",
    "PlannerJob": "torchtitan_seq1f1b.integration.segment_plan",
    "Seq1F1BConfigError": "torchtitan_seq1f1b.integration.segment_plan",
    "plan_align": "torchtitan_seq1f1b.integration.segment_plan",
    "plan_segments": "torchtitan_seq1f1b.integration.segment_plan",
    "planner_problems": "torchtitan_seq1f1b.integration.segment_plan",
    "uses_planner": "torchtitan_seq1f1b.integration.segment_plan",
    "JobFacts": "torchtitan_seq1f1b.integration.summary",
    "run_summary": "torchtitan_seq1f1b.integration.summary",
    "GatedDeltaNetConfig": "torchtitan_seq1f1b.linear_attention",
    "SegmentAwareGatedDeltaNet": "torchtitan_seq1f1b.linear_attention",
    "SegmentAwareImageScatter": "torchtitan_seq1f1b.vision",
    "image_feature_index": "torchtitan_seq1f1b.vision",
}

__all__ = sorted(["MAIN", "install", "titan_release", *TOOLKIT])


def __getattr__(name: str):
    if name not in TOOLKIT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(TOOLKIT[name]), name)


# torchtitan main: after 0.3.0, still versioned 0.2.2; this package appeared there.
MAIN = "main"
MAIN_ONLY_MODULE = "torchtitan.components.data"
# The 0.3 adapter also runs main, reading main's changes by what the tree has.
ADAPTERS = {
    "0.2": "torchtitan_seq1f1b.integration.titan_0_2",
    "0.3": "torchtitan_seq1f1b.integration.titan_0_3",
    MAIN: "torchtitan_seq1f1b.integration.titan_0_3",
}
# The oldest torch each adapter was tested on: the schedules run on torch 2.11 and 2.12,
# but torchtitan 0.2.2's packed-document, compile and validation jobs fail there.
ADAPTER_MIN_TORCH = {"0.2": (2, 13), "0.3": (2, 14), MAIN: (2, 15)}


def titan_release() -> str | None:
    """The installed torchtitan's "major.minor", :data:`MAIN` for a tree past 0.3 (main
    still calls itself 0.2.2; its Grain data package tells it apart), None without
    torchtitan."""
    try:
        release = ".".join(version("torchtitan").split(".")[:2])
    except PackageNotFoundError:
        return None
    return MAIN if find_spec(MAIN_ONLY_MODULE) is not None else release


def install() -> None:
    """Hook Seq1F1B into the running torchtitan through the adapter for its release."""
    release = titan_release()
    if release not in ADAPTERS:
        raise RuntimeError(
            f"torchtitan_seq1f1b has adapters for torchtitan {sorted(ADAPTERS)} but "
            f"torchtitan {version('torchtitan')} is installed; install a supported release "
            "(pip install 'torchtitan==0.2.2' or 'torchtitan==0.3.0')"
        )
    oldest = ADAPTER_MIN_TORCH[release]
    if TORCH_RELEASE < oldest:
        raise RuntimeError(
            f"torchtitan_seq1f1b's torchtitan {release} adapter was tested on torch >= "
            f"{oldest[0]}.{oldest[1]}, and torch {torch.__version__} is installed (the "
            f"schedules alone run on it); install torch {oldest[0]}.{oldest[1]} for "
            f"torchtitan {release} (pip install 'torch=={oldest[0]}.{oldest[1]}.*')"
        )
    import_module(ADAPTERS[release]).install()

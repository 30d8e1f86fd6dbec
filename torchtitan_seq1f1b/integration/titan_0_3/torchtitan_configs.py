# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's own job configs, run as Seq1F1B jobs.

``--module torchtitan_seq1f1b --config qwen3_debugmodel`` finds
``qwen3_debugmodel`` in torchtitan's model registries
(``torchtitan.models.<model>.config_registry``) and returns its job with a
``seq1f1b`` section: schedule Seq1F1B (on torch's 1F1B stage layout), k = 4
balanced segments. Every field stays a flag, ``--seq1f1b.*`` included.

Config names are read from the registries' sources, so a registry that does
not import here (qwen3_5's needs fla) still names its configs, and selecting
one says what to install. A registry loads with a stand-in for torchvision
where it is missing (:func:`~.vision_language.torchvision_stand_in`).
"""

import ast
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.trainer import Trainer

from torchtitan_seq1f1b.integration.titan_0_3.metrics import Seq1F1BMetricsProcessor
from torchtitan_seq1f1b.integration.titan_0_3.options import Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.trainer import Seq1F1BTrainer
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import torchvision_stand_in

__all__ = ["import_registry", "seq1f1b_config", "seq1f1b_job", "torchtitan_config_names"]

# torchtitan's decoder families; the others (flux, muse_glimmer) are not language models.
MODEL_FAMILIES = ("llama3", "qwen3", "qwen3_5", "deepseek_v3", "gpt_oss", "kimi_k2_7")
# Modules a registry imports that an extra of this package installs.
EXTRAS = {"fla": "qwen35"}


def _source_names(family: str) -> list[str]:
    """The public functions a registry's source defines at top level, read without
    importing it (its imports may fail here)."""
    models = importlib.util.find_spec("torchtitan.models")
    path = Path(models.submodule_search_locations[0]) / family / "config_registry.py"
    if not path.is_file():
        return []
    return [
        node.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    ]


def import_registry(family: str, name: str) -> ModuleType:
    """The imported registry of ``family`` (which defines config ``name``); ValueError
    naming the missing module, and the extra that installs it, if it does not import."""
    try:
        # The model package first, outside the stand-in: what it imports (fla imports
        # transformers) must not take the stand-in for torchvision.
        importlib.import_module(f"torchtitan.models.{family}")
        with torchvision_stand_in():
            return importlib.import_module(f"torchtitan.models.{family}.config_registry")
    except ImportError as error:
        extra = EXTRAS.get((error.name or "").partition(".")[0])
        fix = f"; pip install 'torchtitan-seq1f1b[{extra}]'" if extra else ""
        raise ValueError(
            f"--config {name} is in torchtitan's {family} registry, which cannot be "
            f"imported here: {error}{fix}"
        ) from error


def _config_functions(registry: ModuleType) -> dict[str, Callable]:
    """The job-config functions a registry module defines (not those it imports)."""
    return {
        name: fn
        for name, fn in inspect.getmembers(registry, inspect.isfunction)
        if fn.__module__ == registry.__name__ and not name.startswith("_")
    }


def torchtitan_config_names() -> list[str]:
    """Every config function of torchtitan 0.3's decoder registries."""
    return sorted(name for family in MODEL_FAMILIES for name in _source_names(family))


def _fields(config) -> dict:
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


def _pipelining_refusal(config: Trainer.Config) -> str | None:
    """What a config class's own checks say of it at pipeline_parallel_degree 2 (kimi's
    refuse its DistMuon optimizer there), if they refuse it."""
    pipelined = dataclasses.replace(config.parallelism, pipeline_parallel_degree=2)
    try:
        dataclasses.replace(config, parallelism=pipelined)
    except ValueError as error:
        return str(error)
    return None


def seq1f1b_job(config: Trainer.Config, name: str) -> Seq1F1BTrainer.Config:
    """``config`` with a default ``seq1f1b`` section (Seq1F1B on torch's 1F1B
    stage layout, k = 4, balanced; segments a multiple of a chunked loss's chunk
    count), Seq1F1B's metrics, and without CUDA graphs, which torchtitan refuses
    under pipeline parallelism."""
    if type(config) is not Trainer.Config:
        refusal = _pipelining_refusal(config)
        raise ValueError(
            f"--config {name} builds a {type(config).__qualname__}, not torchtitan's "
            "Trainer.Config: Seq1F1B runs jobs of torchtitan's own Trainer only"
            + (f"; torchtitan itself refuses it under pipeline parallelism: {refusal}"
               if refusal else "")
        )
    fields = _fields(config)
    if type(config.metrics) is MetricsProcessor.Config:
        # Logs the plan, K/V peak and bubble, and the run summary.
        fields["metrics"] = Seq1F1BMetricsProcessor.Config(**_fields(config.metrics))
    # torchtitan refuses CUDA graphs with pipeline parallelism at parse time.
    fields["training"].disable_cuda_graphs = True
    # Seq1F1B runs on torch's 1F1B stage layout; flags choose another pair.
    fields["parallelism"].pipeline_parallel_schedule = "1F1B"
    section = Seq1F1BSection(schedule="Seq1F1B", num_segments=4, partition="balanced")
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        # The chunked loss cuts every segment's output into num_chunks equal parts.
        section.align = config.loss.num_chunks
    return Seq1F1BTrainer.Config(**fields, seq1f1b=section)


def seq1f1b_config(name: str, ours: list[str]) -> Callable[[], Seq1F1BTrainer.Config]:
    """The config function ``--config name`` selects: torchtitan's ``name`` as a
    Seq1F1B job. Raises ValueError naming the closest names (``ours`` and
    torchtitan's) if neither has it."""
    family = next((f for f in MODEL_FAMILIES if name in _source_names(f)), None)
    if family is None:
        close = difflib.get_close_matches(name, ours + torchtitan_config_names(), n=5)
        raise ValueError(
            f"--config {name} is neither a torchtitan_seq1f1b config ({', '.join(ours)}) nor "
            f"a config function of torchtitan's model registries; closest: {close}"
        )
    source = _config_functions(import_registry(family, name))[name]

    def config() -> Seq1F1BTrainer.Config:
        return seq1f1b_job(source(), name)

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan.models.{family}.config_registry.{name} under Seq1F1B."
    return config

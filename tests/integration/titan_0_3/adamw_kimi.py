# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's ``kimi_k2_5_debugmodel`` as a pipelinable job: AdamW for DistMuon.

torchtitan's kimi configs train with DistMuon, which it refuses under pipeline
parallelism (``_KimiTrainerConfig``: "Kimi DistMuon currently requires ...
pipeline_parallel_degree=1", TODO #4102). With deepseek_v3_debugmodel's AdamW
in its place, as a plain ``Trainer.Config``, the model itself -- deepseek_v3's
decoder under a MoonViT encoder -- pipelines.

``python -m tests.integration.titan_0_3.adamw_kimi MODULE ARGS...`` runs MODULE
as ``__main__`` (under torchrun, the next launcher or torchtitan.train).
"""

import dataclasses
import functools

from torchtitan.trainer import Trainer

from torchtitan_seq1f1b.integration.titan_0_3.torchtitan_configs import import_registry

from tests.launch import run_next_module

CONFIG = "kimi_k2_5_debugmodel"


def with_adamw() -> None:
    """Make :data:`CONFIG` a ``Trainer.Config`` with deepseek_v3_debugmodel's optimizer."""
    registry = import_registry("kimi_k2_7", CONFIG)
    adamw = import_registry("deepseek_v3", "deepseek_v3_debugmodel").deepseek_v3_debugmodel()
    original = getattr(registry, CONFIG)

    @functools.wraps(original)  # keeps __module__: the adapter lists the registry's own
    def changed():
        job = original()
        fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
        return Trainer.Config(**{**fields, "optimizer": adamw.optimizer})

    setattr(registry, CONFIG, changed)


if __name__ == "__main__":
    with_adamw()
    run_next_module()

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The torchtitan 0.3 adapter: a config registry, a Trainer subclass, a pipelining function.

It also runs torchtitan main, whose folded batch, renamed options and Grain data
:mod:`.release` tells apart by what the tree has.

A job runs as ``torchrun ... -m torchtitan.train --module torchtitan_seq1f1b
--config seq1f1b_debug`` (:mod:`.config_registry`). Its parts:

- :mod:`.options`: the ``seq1f1b`` section (the options shared with the 0.2.2
  adapter plus ``schedule``) and why ``pipeline_parallel_schedule`` stays a
  torch schedule name;
- :mod:`.trainer`: :class:`Seq1F1BTrainer`, carrying the section, checking the
  config on every rank (:mod:`.config_checks`) and binding the options into
  :func:`~.pipeline.pipeline_llm_seq1f1b`;
- :mod:`.attention`: segment-aware attention in torchtitan 0.3's
  inner-attention call, document ids from per-document positions;
- :mod:`.plan`: the segment plan from the model config.

``install()`` runs when the package is imported inside a torchtitan process
(``--module`` imports it): it registers the shipped corpus and, on a machine
without an accelerator, points torchtitan at the CPU with gloo.
"""

from torchtitan_seq1f1b.data import register_datasets
from torchtitan_seq1f1b.integration.cpu import enable_cpu_training

__all__ = ["DEVICE_CONSUMERS", "install"]

# Modules holding ``device_type`` / ``device_module``: torchtitan.tools.utils
# and those that copy them at import time (torchtitan 0.3).
DEVICE_CONSUMERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


def install() -> None:
    """Idempotent; see the module docstring."""
    # Here, not at the top: importing this package imports no torchtitan.
    from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

    enable_cpu_training(DEVICE_CONSUMERS)
    if not FOLDED:  # main's datasets are config objects, not registered names
        register_datasets()

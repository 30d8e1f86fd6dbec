# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's ``qwen3_moe_debug`` with fewer routed experts.

At its 64 experts the config has 316M parameters, nearly all of them experts,
and its seed checkpoint, optimizer and expert loop dominate a CPU job. The
end-to-end job tests cut it to :data:`NUM_EXPERTS`, which keeps every code path
(routing over more experts than each token's top-k, dispatch, load balancing)
that 64 take.

``python -m tests.integration.titan_0_3.fewer_experts MODULE ARGS...`` runs
MODULE as ``__main__`` (under torchrun, the next launcher or torchtitan.train)
with ``torchtitan.models.qwen3.config_registry.qwen3_moe_debug`` returning
the cut config.
"""

import dataclasses
import functools

from tests.launch import run_next_module

NUM_EXPERTS = 16


def with_experts(config, num_experts: int):
    """``config`` with every expert count inside it (and the router's gate width) set."""
    changes = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "num_experts":
            changes[field.name] = num_experts
        elif field.name == "gate":
            changes[field.name] = dataclasses.replace(value, out_features=num_experts)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = with_experts(value, num_experts)
    return dataclasses.replace(config, **changes)


def _cut_qwen3_moe_debug() -> None:
    from torchtitan.models.qwen3 import config_registry

    original = config_registry.qwen3_moe_debug

    @functools.wraps(original)  # keeps __module__: the adapter lists the registry's own
    def qwen3_moe_debug():
        job = original()
        model = job.model_spec.model
        layers = [with_experts(layer, NUM_EXPERTS) for layer in model.layers]
        job.model_spec.model = dataclasses.replace(model, layers=layers)
        return job

    config_registry.qwen3_moe_debug = qwen3_moe_debug


if __name__ == "__main__":
    _cut_qwen3_moe_debug()
    run_next_module()

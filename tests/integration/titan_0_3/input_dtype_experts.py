# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's routed experts computed in their inputs' dtype, not in bf16.

``GroupedExperts.forward`` casts tokens and expert weights to bf16 whatever the
model's dtype, so each call rounds its expert weight gradients to bf16 once:
once per segment under Seq1F1B, once per microbatch unpipelined. Exactness
tests of MoE models replace it with :func:`experts_in_input_dtype` (gpt_oss's
with :func:`gpt_oss_experts_in_input_dtype`); routing, dispatch, combine and
load balancing stay torchtitan's.

``python -m tests.integration.titan_0_3.input_dtype_experts MODULE ARGS...``
runs MODULE as ``__main__`` (under torchrun, the next launcher or
torchtitan.train) with the replacement in place.
"""


import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu

from tests.launch import run_next_module


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of ``weight``: expert parallelism shards dim 0 (experts)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def experts_in_input_dtype(
    self: GroupedExperts, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """``GroupedExperts.forward`` in x_RD's dtype: x_RD (tokens, dim), grouped by
    expert, ``num_tokens_per_expert_E`` (experts,) -> (tokens, dim)."""
    groups = x_RD.split(num_tokens_per_expert_E.tolist())
    return torch.cat([
        (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
        for x, w1, w2, w3 in zip(
            groups, _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        )
    ])


def gpt_oss_experts_in_input_dtype(
    self: GptOssGroupedExperts, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """``GptOssGroupedExperts.forward`` (biases, clamped SwiGLU) in x_RD's dtype."""
    groups = x_RD.split(num_tokens_per_expert_E.tolist())
    weights = zip(*map(_local, (
        self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED
    )))
    return torch.cat([
        swiglu(x @ w1.T + b1, limit=self.swiglu_limit) @ w2.T + b2
        for x, (w1, b1, w2, b2) in zip(groups, weights)
    ])


if __name__ == "__main__":
    GroupedExperts.forward = experts_in_input_dtype
    GptOssGroupedExperts.forward = gpt_oss_experts_in_input_dtype
    run_next_module()

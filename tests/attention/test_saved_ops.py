# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every attention backend's forward dispatches an op that op-level checkpointing saves.

The CUDA kernels run here on meta tensors, through torch's own meta and fake
implementations of the real ops: what is counted is the op the real kernel
call dispatches, not a stand-in's.
"""

import pytest
import torch

from torchtitan_seq1f1b.attention import attention_forward_ops, SDPABackend
from torchtitan_seq1f1b.attention.cuda_mem_efficient import lower_right_causal_attention_cuda
from torchtitan_seq1f1b.attention.torch_varlen import (
    lower_right_causal_attention_flash,
    varlen_attention,
)
from torchtitan_seq1f1b.check.counters import AttentionForwardCounter


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def _cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to("meta")


def _count(run) -> int:
    with AttentionForwardCounter() as counter:
        run()
    return counter.count


@pytest.mark.parametrize(
    "run",
    [
        # mask-free exact path on CUDA: aten._efficient_attention_forward
        lambda: lower_right_causal_attention_cuda(_meta(2, 8, 4, 64), _meta(2, 16, 2, 64),
                                                  _meta(2, 16, 2, 64), None),
        # varlen backend, dense: aten._scaled_dot_product_flash_attention
        lambda: lower_right_causal_attention_flash(_meta(2, 8, 4, 64), _meta(2, 16, 2, 64),
                                                   _meta(2, 16, 2, 64), None),
        # varlen backend, packed documents: torch_attn._varlen_attn
        lambda: varlen_attention(_meta(8, 4, 64), _meta(16, 2, 64), _meta(16, 2, 64),
                                 _cu(3, 5), _cu(5, 11), 5, 11, None),
        # exact path on CPU, a segment after a prefix and the first segment
        lambda: SDPABackend()(*(torch.randn(1, n, 2, 8) for n in (4, 12, 12)), None),
        lambda: SDPABackend()(*(torch.randn(1, 12, 2, 8) for _ in range(3)), None),
    ],
    ids=["cuda_mem_efficient", "torch_flash", "torch_varlen", "cpu_prefix", "cpu_first"],
)
def test_each_kernel_call_dispatches_one_saved_op(run):
    assert _count(run) == 1


def test_flash_attn_ops_are_saved_once_registered():
    """flash-attn registers ``flash_attn::_flash_attn_forward`` and
    ``_flash_attn_varlen_forward``; they join the save set when present."""
    if hasattr(torch.ops.flash_attn, "_flash_attn_forward"):
        pytest.skip("flash-attn is installed; its real ops are registered")
    names = ("_flash_attn_forward", "_flash_attn_varlen_forward")
    before = attention_forward_ops()
    library = torch.library.Library("flash_attn", "FRAGMENT")
    try:
        for name in names:
            library.define(f"{name}(Tensor q) -> Tensor")
        added = attention_forward_ops() - before
        assert {str(op) for op in added} == {f"flash_attn.{name}.default" for name in names}
    finally:
        library._destroy()

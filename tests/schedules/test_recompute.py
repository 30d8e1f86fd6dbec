# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How often attention runs in a pipelined step, per checkpointing mode.

A dispatch mode pushed on each rank's training thread counts the attention
forward ops of a second training step (the first also runs torch's shape
inference), with backward on a fresh thread, which inherits the mode as
autograd's device threads do. Per rank, with U units (microbatches x
segments) and L attention layers:

- no checkpointing and op-level selective checkpointing, which saves
  attention: U * L in the step;
- full checkpointing: every layer's attention again in backward, 2 * U * L;
- layer-level selective checkpointing: again for the checkpointed layers only.

The counted step's gradients are also compared with the unsplit reference.
Each GPU backend runs its real call path on CPU kernels registered under its
ops' names (:mod:`tests.registered_kernels`), which count their own calls
too, dense and with packed documents.
"""

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch

from torchtitan_seq1f1b.attention import TorchFlashBackend
from torchtitan_seq1f1b.attention.cuda_mem_efficient import lower_right_causal_attention_cuda
from torchtitan_seq1f1b.check.counters import AttentionForwardCounter

from tests.harness import Case, reference, runs_by_case, second_step_under
from tests.kernel_fakes import cuda_exact_path, StandIn
from tests.registered_kernels import flash_attn_stand_in, FORWARD_CALLS, register_cpu_kernels

RTOL, ATOL = 1e-10, 1e-14
WORLD_SIZE = 2
DOCUMENTS = ((4, 13, 2, 11), (30,), (1,) * 30)
CASES = [
    *(Case(2, (12, 10, 8), n_kv_heads=2, activation_checkpoint=mode)
      for mode in ("none", "selective_op", "full", "selective_layer")),
    *(Case(2, (12, 10, 8), n_kv_heads=2, activation_checkpoint=mode, documents=DOCUMENTS)
      for mode in ("selective_op", "full")),
    *(Case(1, (16, 14), schedule="InterleavedSeq1F1B", stages_per_rank=2,
           activation_checkpoint=mode)
      for mode in ("selective_op", "full")),
    *(Case(1, (12, 10, 8), n_kv_heads=2, activation_checkpoint="selective_op",
           documents=documents, kernel=kernel)
      for kernel in ("varlen", "flash")
      for documents in (None, DOCUMENTS)),
    *(Case(1, (12, 10, 8), n_kv_heads=2, activation_checkpoint=mode, kernel="cuda_exact")
      for mode in ("selective_op", "full")),
]


def _backend(kernel: str):
    if kernel == "exact":
        return None
    register_cpu_kernels()
    if kernel == "varlen":
        return StandIn("varlen", TorchFlashBackend())
    if kernel == "flash":
        return StandIn("flash", flash_attn_stand_in())
    exact_cuda = functools.partial(lower_right_causal_attention_cuda, ops=torch.ops.aten)
    return StandIn("cuda_exact", functools.partial(cuda_exact_path, exact_cuda))


@contextlib.contextmanager
def _kernels_agree(counter: AttentionForwardCounter, kernel: str) -> Iterator[None]:
    """``counter`` active; the registered kernels' own count of the same calls agrees."""
    calls = sum(FORWARD_CALLS.values())
    with counter:
        yield
    if kernel != "exact":
        assert sum(FORWARD_CALLS.values()) - calls == counter.count, (FORWARD_CALLS, counter.count)


def _second_step_counted(rank: int, world_size: int, case: Case) -> tuple[int, dict]:
    counter = AttentionForwardCounter()
    parts = second_step_under(
        rank, world_size, case, _backend(case.kernel), _kernels_agree(counter, case.kernel)
    )
    return counter.count, {n: p.grad for part in parts for n, p in part.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    return runs_by_case(_second_step_counted, WORLD_SIZE, CASES)


def _layers_of_rank(case: Case, rank: int) -> list[int]:
    """The attention layers rank ``rank`` holds (stages ``rank + c * WORLD_SIZE``)."""
    stages = WORLD_SIZE * case.stages_per_rank
    layers = []
    for stage in range(rank, stages, WORLD_SIZE):
        layers += range(round(stage * case.n_layers / stages),
                        round((stage + 1) * case.n_layers / stages))
    return layers


def _recomputed(case: Case, layers: list[int]) -> int:
    if case.activation_checkpoint == "full":
        return len(layers)
    if case.activation_checkpoint == "selective_layer":
        return sum(layer % 2 == 0 for layer in layers)
    return 0


@pytest.mark.parametrize(
    "case", CASES,
    ids=lambda c: (
        f"{c.kernel}-{c.schedule}-{c.activation_checkpoint}{'-documents' if c.documents else ''}"
    ),
)
def test_attention_runs_once_per_unit_and_layer_unless_recomputed(runs, case):
    units = case.n_microbatches * len(case.lengths)
    for rank, (count, _) in enumerate(runs[case]):
        layers = _layers_of_rank(case, rank)
        assert count == units * (len(layers) + _recomputed(case, layers)), f"rank {rank}"
    ref = reference(case)
    grads = {name: g for _, rank in runs[case] for name, g in rank.items()}
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)

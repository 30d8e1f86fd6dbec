# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Compiled blocks under the schedules, float64, against eager unsplit training.

Each stage compiles every block with ``fullgraph=True``, checkpointing inside
the compiled region, as torchtitan does; the reference is the eager unsplit
model. Packed documents, every checkpointing mode, backward on a fresh thread.
The split-backward schedules are not here: torch's compiled backward refuses
their retain_graph input step (pytorch/pytorch#161904), and the adapters
refuse that combination at start-up.
"""

import pytest

from torchtitan_seq1f1b._torch_compat import TORCH_RELEASE
from torchtitan_seq1f1b._torch_compat.compile_counts import compiled_graphs, recompile_limit

from tests.harness import (
    assert_matches_reference,
    Case,
    pipelined_broken,
    pipelined_cases,
    reference,
    run_ranks,
    worst_relative_grad_error,
)

RTOL, ATOL = 1e-10, 1e-14
DOCUMENTS = ((5, 17, 8), (30,))
SELECTIVE_OP = Case(
    2, (12, 10, 8), activation_checkpoint="selective_op", documents=DOCUMENTS, compile=True
)
CASES = [
    Case(2, (12, 10, 8), activation_checkpoint="full", documents=DOCUMENTS, compile=True),
    SELECTIVE_OP,
    Case(
        3, (10, 8, 6, 6), schedule="InterleavedSeq1F1B", stages_per_rank=2,
        activation_checkpoint="selective_layer", documents=((7, 23), (30,)), compile=True,
    ),
]
# torch 2.12's inductor fails to compile some checkpointed blocks' backwards (selective op
# checkpointing among them) on a thread other than the forward's, where CUDA runs them
# ("both a fallback and a decomp for same op: aten.t.default"); 2.11 and 2.13+ compile
# them. The last test shows the failure.
COMPILES_ON_A_BACKWARD_THREAD = TORCH_RELEASE != (2, 12)


def _cases_and_graphs(rank: int, world_size: int, cases: list[Case]):
    """The cases, then the first with prefix dK/dV dropped (reusing its compiled graphs),
    and how many graphs dynamo compiled."""
    # Three checkpointing modes, train and eval, through one block's code object: torch
    # 2.11 guards each apart and passes dynamo's default of 8 graphs; a job runs one mode.
    with recompile_limit(16):
        results = pipelined_cases(rank, world_size, cases)
        broken = pipelined_broken(rank, world_size, [(cases[0], "prefix_grads")])[0]
    return results, broken, compiled_graphs()


@pytest.mark.skipif(not COMPILES_ON_A_BACKWARD_THREAD, reason="torch 2.12's inductor (below)")
def test_compiled_blocks_give_the_eager_unsplit_gradients():
    """With a negative control: prefix dK/dV dropped inside the compiled blocks' op."""
    per_rank = run_ranks(_cases_and_graphs, 2, CASES, timeout=900)
    for i, case in enumerate(CASES):
        assert_matches_reference([rank[0][i] for rank in per_rank], case, RTOL, ATOL)
    # The blocks did compile: at least a forward graph per case on every rank.
    assert all(graphs >= len(CASES) for *_, graphs in per_rank), per_rank
    broken = [rank[1] for rank in per_rank]
    assert worst_relative_grad_error(broken, reference(CASES[0])) > 1e-3


@pytest.mark.skipif(COMPILES_ON_A_BACKWARD_THREAD, reason="this torch compiles them (above)")
def test_torch_2_12_cannot_compile_a_checkpointed_backward_on_another_thread():
    """Fails once torch 2.12's inductor compiles it: then the grid above runs on 2.12 too."""
    with pytest.raises(Exception, match="both a fallback and a decomp for same op"):
        run_ranks(pipelined_cases, 2, [SELECTIVE_OP], timeout=900)

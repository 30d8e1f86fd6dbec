# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Context parallelism (CP = 2) with every schedule (PP = 2), float64, on 4 gloo ranks.

Ranks are laid out as torchtitan's mesh lays them, PP outermost: rank
``2 * pp_rank + cp_rank``. Each CP rank runs the schedule on its head-tail
share of every segment; its parameter gradients, summed over the CP group, and
its per-microbatch loss sums, summed likewise, must equal the unsplit
single-process reference's at rtol 1e-10, every backward on a fresh thread:
every schedule, uneven plans, GQA, every checkpointing mode, packed documents
whose borders fall inside segments and inside head-tail pieces, sliding windows
crossing both.
"""

import pytest
import torch

from torchtitan_seq1f1b.check.exactness import Case, context_parallel_pipelined, reference
from torchtitan_seq1f1b.local_ranks import run_ranks

CP, PP = 2, 2
RTOL, ATOL = 1e-10, 1e-14


def _cp_pipelined(rank, world_size, case: Case) -> dict:
    return context_parallel_pipelined(rank, world_size, case, CP)


# Per row, document lengths with borders inside segments and head-tail pieces.
DOCUMENTS = ((5, 9, 2, 8), (24,))
CASES = {
    f"{schedule}-{lengths}-kv{kv}-{checkpoint}"
    + ("-documents" if documents else "") + (f"-window{window}" if window else ""): Case(
        2, lengths, n_kv_heads=kv, schedule=schedule,
        stages_per_rank=1 if schedule in ("Seq1F1B", "Seq1F1BZeroBubble") else 2,
        activation_checkpoint=checkpoint, documents=documents, window_left=window,
    )
    for schedule, lengths, kv, checkpoint, documents, window in [
        ("Seq1F1B", (24,), 4, "none", None, None),
        ("Seq1F1B", (8, 12, 4), 2, "full", DOCUMENTS, None),
        ("Seq1F1B", (4, 8, 4, 8), 4, "selective_op", None, 5),
        ("InterleavedSeq1F1B", (8, 12, 4), 2, "selective_layer", DOCUMENTS, None),
        ("Seq1F1BZeroBubble", (8, 12, 4), 2, "full", None, None),
        ("Seq1F1BZBV", (12, 4, 8), 2, "none", DOCUMENTS, 5),
    ]
}


@pytest.mark.parametrize("name", list(CASES))
def test_cp2_pp2_equals_the_unsplit_reference(name):
    case = CASES[name]
    ranks = run_ranks(_cp_pipelined, CP * PP, case, timeout=300)
    ref = reference(case)
    grads = {}
    for result in ranks:
        if result["cp_rank"] == 0:
            grads.update(result["grads"])
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    last = [r for r in ranks if r["last"]]
    for result in last:
        torch.testing.assert_close(result["losses"], torch.stack(ref["loss_sums"]), rtol=RTOL, atol=0)

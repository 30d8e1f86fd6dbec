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

Every rank also records the CP collectives it issues in the step, in issue
order, with the compute step that issued each: per attention layer and unit,
one all-gather in the unit's forward and one reduce-scatter in its backward,
of the rank's share of the segment; the same sequence on both CP ranks of a
stage and, for one schedule and plan, under every checkpointing mode.
"""

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from torchtitan_seq1f1b.check.exactness import (
    Case,
    context_parallel_pipelined,
    reference,
    SCHEDULES,
)
from torchtitan_seq1f1b.context_parallel import collectives
from torchtitan_seq1f1b.examples.tiny_transformer import ACTIVATION_CHECKPOINT_MODES
from torchtitan_seq1f1b.integration.schedules import SPLIT_BACKWARD_SCHEDULES
from torchtitan_seq1f1b.stepping.unit_compute import UnitComputeScope

from tests.harness import runs_by_case

CP, PP = 2, 2
RTOL, ATOL = 1e-10, 1e-14


@contextlib.contextmanager
def _recorded_collectives() -> Iterator[list[tuple]]:
    """Records every CP all-gather and reduce-scatter in issue order, as
    (collective, shape of this rank's share, stage index, step kind F/B/I/W, chunk id),
    the step being the stage's compute call (its unit scope) that issued it."""
    records, steps = [], []
    scope = UnitComputeScope.__call__

    @contextlib.contextmanager
    def tagged(self, stage, chunk_id, kind):
        with scope(self, stage, chunk_id, kind):
            steps.append((stage.stage_index, kind, chunk_id))
            try:
                yield
            finally:
                steps.pop()

    def recorded(name: str, collective):
        def issue(output, input, group):
            share = input if name == "all_gather" else output
            records.append((name, tuple(share.shape), *steps[-1]))
            return collective(output, input, group=group)

        return issue

    with (
        mock.patch.object(UnitComputeScope, "__call__", tagged),
        mock.patch.object(
            collectives, "_all_gather", recorded("all_gather", collectives._all_gather)
        ),
        mock.patch.object(
            collectives, "_reduce_scatter",
            recorded("reduce_scatter", collectives._reduce_scatter),
        ),
    ):
        yield records


def _cp_pipelined(rank, world_size, case: Case) -> dict:
    with _recorded_collectives() as records:
        result = context_parallel_pipelined(rank, world_size, case, CP)
    return {**result, "collectives": records}


def _assert_exact(case: Case, ranks: list[dict]) -> None:
    ref = reference(case)
    grads = {}
    for result in ranks:
        if result["cp_rank"] == 0:
            grads.update(result["grads"])
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    last = [r for r in ranks if r["last"]]
    assert last
    for result in last:
        torch.testing.assert_close(result["losses"], torch.stack(ref["loss_sums"]), rtol=RTOL, atol=0)


def _backward_step(case: Case, stage: int) -> str:
    """The step kind whose backward reaches attention: under split backwards the
    input-gradient step, except on the first stage (its inputs are tokens), where
    torch runs the whole backward in the weight-gradient step."""
    if case.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return "B"
    return "W" if stage == 0 else "I"


def _assert_collectives(case: Case, ranks: list[dict]) -> None:
    """Per rank, stage, attention layer and unit one all-gather in the unit's forward
    and one reduce-scatter in its backward, each of shape (k and v, microbatch_size,
    len_j / CP, kv_heads, head_dim); the same sequence on both CP ranks of a stage."""
    k, num_stages = len(case.lengths), PP * case.stages_per_rank
    units = case.n_microbatches * k
    layers = case.n_layers // num_stages
    head_dim = case.model_args.dim // case.model_args.n_heads
    for rank, result in enumerate(ranks):
        pp_rank = rank // CP
        if case.schedule == "Seq1F1BZBV":
            stages = {pp_rank, num_stages - 1 - pp_rank}
        else:
            stages = set(range(pp_rank, num_stages, PP))
        expected = Counter()
        for stage in stages:
            for chunk in range(units):
                length = case.lengths[chunk % k] // CP
                share = (2, case.microbatch_size, length, case.n_kv_heads, head_dim)
                backward = _backward_step(case, stage)
                expected["all_gather", share, stage, "F", chunk] = layers
                expected["reduce_scatter", share, stage, backward, chunk] = layers
        records = result["collectives"]
        assert len(records) == 2 * len(stages) * layers * units, (rank, records)
        assert Counter(records) == expected, (rank, records)
    for rank in range(0, CP * PP, CP):
        for other in range(rank + 1, rank + CP):
            assert ranks[other]["collectives"] == ranks[rank]["collectives"], (rank, other)


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


# Every schedule under every checkpointing mode it accepts (op-level checkpointing
# allows one backward per region; a split backward runs two), on one plan, one
# microbatch, one layer per stage: CASES count over several of each.
MODES = {
    schedule: [
        Case(
            1, (8, 4), n_kv_heads=2, schedule=schedule, activation_checkpoint=mode,
            stages_per_rank=stages_per_rank, n_layers=PP * stages_per_rank,
        )
        for mode in ACTIVATION_CHECKPOINT_MODES
        if not (mode == "selective_op" and schedule in SPLIT_BACKWARD_SCHEDULES)
    ]
    for schedule in SCHEDULES
    for stages_per_rank in [1 if schedule in ("Seq1F1B", "Seq1F1BZeroBubble") else 2]
}


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every case's results per rank, all from one launch of 4 ranks."""
    return runs_by_case(_cp_pipelined, CP * PP, [*CASES.values(), *sum(MODES.values(), [])])


@pytest.mark.parametrize("name", list(CASES))
def test_cp2_pp2_equals_the_unsplit_reference(runs, name):
    case = CASES[name]
    _assert_exact(case, runs[case])
    _assert_collectives(case, runs[case])


@pytest.mark.parametrize("schedule", list(MODES))
def test_collectives_are_the_same_under_every_checkpointing_mode(runs, schedule):
    first, *others = MODES[schedule]
    for case in MODES[schedule]:
        _assert_exact(case, runs[case])
        _assert_collectives(case, runs[case])
    for case in others:
        for rank, (got, expected) in enumerate(zip(runs[case], runs[first])):
            assert got["collectives"] == expected["collectives"], (case.activation_checkpoint, rank)

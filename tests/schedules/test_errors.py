# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Bad configurations fail early, clearly, and on every rank (never a hang)."""

import contextlib
from unittest import mock

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    SegmentPlan,
)
from torchtitan_seq1f1b._torch_compat import ALLOW_UNTESTED_ENV, check_torch_version
from torchtitan_seq1f1b.examples.tiny_transformer import token_sum_cross_entropy
from torchtitan_seq1f1b.stepping.microbatch_inputs import MicrobatchInputs
from torchtitan_seq1f1b.stepping.rank_errors import input_signature

from tests.harness import Case, RankFailure, run_ranks

CASE = Case(n_microbatches=2, lengths=(6, 4, 2))


def _stage(rank: int, world_size: int) -> PipelineStage:
    return PipelineStage(
        CASE.model().stage(rank, world_size), rank, world_size, torch.device("cpu")
    )


def _construct(rank, world_size, bad):
    stage = _stage(rank, world_size)
    kwargs = dict(n_microbatches=2, segment_plan=CASE.plan, loss_fn=token_sum_cross_entropy)
    if bad == "plan":
        kwargs["segment_plan"] = (6, 4, 2)
    elif bad == "microbatches":
        kwargs["n_microbatches"] = 0
    elif bad == "two_stages":
        stage = [stage, stage]
    ScheduleSeq1F1B(stage, **kwargs)


@pytest.mark.parametrize(
    "bad,error,match",
    [
        ("plan", TypeError, "segment_plan must be a SegmentPlan"),
        ("microbatches", ValueError, "n_microbatches=0"),
        ("two_stages", ValueError, "one stage per rank"),
    ],
)
def test_constructor_rejects_bad_config_on_every_rank(bad, error, match):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_construct, 2, bad, timeout=120)
    assert set(failure.value.errors) == {0, 1}
    for message in failure.value.errors.values():
        assert message.startswith(error.__name__) and match in message


def _construct_variant(rank, world_size, schedule, placement):
    """Two stages per rank, placed in a loop (r, r+p) or in a V (r, 2p-1-r)."""
    model = Case(2, (6, 4, 2), n_layers=4).model()
    num_stages = 2 * world_size
    second = rank + world_size if placement == "loop" else num_stages - 1 - rank
    indices = [rank] if placement == "one" else [rank, second]
    stages = [
        PipelineStage(model.stage(i, num_stages), i, num_stages, torch.device("cpu"))
        for i in indices
    ]
    {"interleaved": ScheduleInterleavedSeq1F1B, "zbv": ScheduleSeq1F1BZBV}[schedule](
        stages, 2, CASE.plan, loss_fn=token_sum_cross_entropy
    )


@pytest.mark.parametrize(
    "schedule,placement,match",
    [
        ("interleaved", "one", "at least 2 stages per rank"),
        ("interleaved", "v", "places stages in a loop: with 2 ranks and 2 stages per rank, "
         "rank 0 must hold stages [0, 2]"),
        ("zbv", "loop", "places two stages per rank in a V: with 2 ranks, rank 0 must hold "
         "stages [0, 3]"),
    ],
)
def test_variants_reject_the_wrong_stage_placement(schedule, placement, match):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_construct_variant, 2, schedule, placement, timeout=120)
    assert match in failure.value.errors[0]


def _step_with_bad_input(rank, world_size, bad):
    schedule = ScheduleSeq1F1B(
        _stage(rank, world_size), 2, CASE.plan, loss_fn=token_sum_cross_entropy,
        positions_kwarg="positions", document_ids_kwarg="document_ids",
    )
    tokens, target = CASE.batch()
    if bad == "input":
        tokens = tokens[:, :-1]
    elif bad == "target":
        target = target[:, :-2]
    documents = {}
    if bad == "document_ids" and rank == 1:
        ids = torch.zeros(tokens.shape, dtype=torch.long)
        ids[:, 5] = 1  # a document id that decreases again
        documents = {"document_ids": ids}
    is_last = rank == world_size - 1
    schedule.step(
        *((tokens,) if rank == 0 else ()), target=target if is_last else None, **documents
    )


@pytest.mark.parametrize(
    "bad,culprit,shape", [("input", 0, "(4, 11)"), ("target", 2, "(4, 10)")]
)
def test_bad_step_input_fails_on_every_rank_without_hanging(bad, culprit, shape):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_step_with_bad_input, 3, bad, timeout=120)
    assert set(failure.value.errors) == {0, 1, 2}
    for message in failure.value.errors.values():
        assert f"pipeline rank {culprit}" in message
        assert f"of shape {shape} does not have seq_len=12" in message


def test_bad_document_ids_fail_on_every_rank_naming_the_keyword():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_step_with_bad_input, 3, "document_ids", timeout=120)
    assert set(failure.value.errors) == {0, 1, 2}
    for message in failure.value.errors.values():
        assert "pipeline rank 1: document_ids: document ids decrease along a row" in message


def test_untested_torch_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"tested with torch>=2.11,<2.16.*pip install"):
        check_torch_version("2.16.0")
    with pytest.raises(RuntimeError, match=ALLOW_UNTESTED_ENV):
        check_torch_version("2.10.0+cpu")
    for tested in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"):
        check_torch_version(tested)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_torch_version("2.16.0")


def test_segment_plan_must_fit_sequence_length():
    with pytest.raises(ValueError, match="seq_len"):
        SegmentPlan.uniform(10, 11)


def test_sequence_parallel_shards_scale_with_segment_length():
    from torchtitan_seq1f1b.segmenting import scaled_seq_len

    assert scaled_seq_len(8, 16, 12) == 6  # tp=2: 16 tokens held as 8 entries
    assert scaled_seq_len(16, 16, 13) == 13
    with pytest.raises(ValueError, match="multiple of the sequence-parallel degree"):
        scaled_seq_len(8, 16, 13)


def _second_step(rank, world_size, bad):
    """A good first step, then ``bad`` at the second; returns the second
    step's collectives when it is good."""
    schedule = ScheduleSeq1F1B(
        _stage(rank, world_size), 2, CASE.plan, loss_fn=token_sum_cross_entropy,
        document_ids_kwarg="document_ids",
    )
    tokens, target = CASE.batch()
    ids = torch.zeros(tokens.shape, dtype=torch.long)
    ids[:, 7:] = 1

    def step(tokens, ids):
        schedule.step(
            *((tokens,) if rank == 0 else ()),
            target=target if rank == world_size - 1 else None,
            document_ids=ids,
        )

    step(tokens, ids)
    if bad == "document_ids":
        ids[:, 9] = 0  # every rank gets ids that decrease
    elif bad == "input" and rank == 0:
        tokens = tokens.int()  # only the first stage holds the inputs
    collectives = []
    with contextlib.ExitStack() as counting:
        for name in ("all_reduce", "all_gather_object", "broadcast", "barrier"):
            real = getattr(torch.distributed, name)
            counting.enter_context(mock.patch.object(
                torch.distributed, name,
                lambda *a, _real=real, _name=name, **k: collectives.append(_name) or _real(*a, **k),
            ))
        step(tokens, ids)
    return collectives


def test_a_steady_state_step_runs_no_collective():
    assert run_ranks(_second_step, 2, "none", timeout=120) == [[], []]


def test_bad_document_ids_at_a_later_step_fail_on_every_rank_alone():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_second_step, 2, "document_ids", timeout=120)
    assert set(failure.value.errors) == {0, 1}
    for rank, message in failure.value.errors.items():
        assert f"pipeline rank {rank}: document_ids: document ids decrease" in message


def test_an_input_changed_at_a_later_step_fails_naming_it_without_hanging():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_second_step, 2, "input", timeout=120)
    assert "pipeline rank 0: inputs are ((((2, 12), torch.int32),), " in failure.value.errors[0]
    assert "the pipeline's buffers are sized at the first call" in failure.value.errors[0]
    # Only rank 0 could tell; rank 1 fails when rank 0's process leaves, as under torchrun.
    assert set(failure.value.errors) == {0, 1}


def test_inputs_passed_whole_may_change_shape_but_not_dtype_or_rank():
    """A VLM's images (``whole_kwargs``) differ in count per microbatch and step; every
    unit takes them uncut, so no buffer depends on their shape. Cut inputs must keep theirs."""

    def signature(pixels: torch.Tensor, positions: torch.Tensor):
        inputs = MicrobatchInputs(
            args=[()], kwargs=[{"pixel_values": pixels, "positions": positions}],
            targets=None, document_ids=None,
        )
        return input_signature(inputs, frozenset({"pixel_values"}))

    positions = torch.arange(12)[None]
    first = signature(torch.zeros(24, 6), positions)
    assert signature(torch.zeros(32, 6), positions) == first
    assert signature(torch.zeros(32, 6, dtype=torch.float64), positions) != first
    assert signature(torch.zeros(32, 6, 1), positions) != first
    assert signature(torch.zeros(24, 6), torch.arange(13)[None]) != first

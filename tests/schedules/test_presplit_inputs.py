# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Pre-split microbatches (``arg_mbs``/``kwarg_mbs``/``target_mbs``) run the step whole batches run.

torch 2.14+ schedules and torchtitan 0.3's trainer hand ``step()`` and
``eval()`` microbatches the caller already split; torch 2.14+'s base
``eval()`` always passes them on as keywords.
"""

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import ScheduleSeq1F1B
from torchtitan_seq1f1b._torch_compat import _release
from torchtitan_seq1f1b.examples.tiny_transformer import token_sum_cross_entropy

from tests.harness import Case, RankFailure, run_ranks

CASE = Case(n_microbatches=2, lengths=(6, 4, 2), documents=((5, 7), (12,)))


def _rows(tensor: torch.Tensor, m: int) -> list[torch.Tensor]:
    return list(tensor.chunk(m))


def _steps(rank, world_size, form):
    model = CASE.model()
    stage = PipelineStage(model.stage(rank, world_size), rank, world_size, torch.device("cpu"))
    schedule = ScheduleSeq1F1B(
        stage, CASE.n_microbatches, CASE.plan, loss_fn=token_sum_cross_entropy,
        positions_kwarg="positions", document_ids_kwarg="document_ids",
    )
    tokens, target = CASE.batch()
    ids = CASE.document_ids()
    first, last, m = rank == 0, rank == world_size - 1, CASE.n_microbatches
    losses: list = []
    if form == "whole":
        step_inputs = dict(target=target if last else None, document_ids=ids)
        args = (tokens,) if first else ()
    else:
        step_inputs = dict(
            arg_mbs=[(t,) for t in _rows(tokens, m)] if first else None,
            kwarg_mbs=[{"document_ids": i} for i in _rows(ids, m)],
            target_mbs=_rows(target, m) if last else None,
        )
        args = ()
    schedule.step(*args, losses=losses, **step_inputs)
    with torch.no_grad():
        logits = schedule.eval(*args, **step_inputs)
    return {
        "grads": {n: p.grad.clone() for n, p in stage.submod.named_parameters()},
        "losses": losses,
        "logits": logits,
    }


def test_presplit_microbatches_give_the_whole_batch_step_and_eval():
    whole = run_ranks(_steps, 2, "whole", timeout=120)
    presplit = run_ranks(_steps, 2, "presplit", timeout=120)
    for rank in (0, 1):
        assert whole[rank]["grads"].keys() == presplit[rank]["grads"].keys()
        for name, grad in whole[rank]["grads"].items():
            assert torch.equal(grad, presplit[rank]["grads"][name]), name
    torch.testing.assert_close(presplit[1]["losses"], whole[1]["losses"], rtol=0, atol=0)
    assert torch.equal(presplit[1]["logits"], whole[1]["logits"])
    rows = CASE.n_microbatches * CASE.microbatch_size
    assert presplit[1]["logits"].shape == (rows, 12, CASE.model_args.vocab_size)


def _mixed_inputs(rank, world_size, bad):
    stage = PipelineStage(
        CASE.model().stage(rank, world_size), rank, world_size, torch.device("cpu")
    )
    schedule = ScheduleSeq1F1B(stage, 2, CASE.plan, loss_fn=token_sum_cross_entropy)
    tokens, target = CASE.batch()
    last = rank == world_size - 1
    if bad == "mixed":
        schedule.step(target=target if last else None, kwarg_mbs=[{}, {}])
    elif bad == "count":
        schedule.step(target_mbs=[target] if last else None)
    elif bad == "finalize":
        schedule.step(
            *((tokens,) if rank == 0 else ()),
            target=target if last else None,
            finalize_gradients=False,
        )


@pytest.mark.parametrize(
    "bad,culprit,match",
    [
        ("mixed", 1, "target passed together with pre-split"),
        ("count", 1, "target_mbs must be a list of 2 microbatches; got 1"),
    ],
)
def test_bad_presplit_inputs_fail_on_every_rank(bad, culprit, match):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_mixed_inputs, 2, bad, timeout=120)
    assert set(failure.value.errors) == {0, 1}
    for message in failure.value.errors.values():
        assert f"pipeline rank {culprit}: {match}" in message


def test_finalize_gradients_false_runs_on_torch_2_15_and_is_refused_before():
    if _release(torch.__version__) >= (2, 15):
        run_ranks(_mixed_inputs, 2, "finalize", timeout=120)
        return
    with pytest.raises(RankFailure) as failure:
        run_ranks(_mixed_inputs, 2, "finalize", timeout=120)
    assert set(failure.value.errors) == {0, 1}
    assert "step(finalize_gradients=False) needs torch >= 2.15" in failure.value.errors[0]

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""ScheduleSeq1F1B against unsplit, non-pipelined training, in float64.

Every case runs one training step and one eval() of a small llama-style
transformer on pp gloo ranks and compares gradients, per-microbatch losses and
logits with a single-process, unsplit reference (rtol 1e-10).
"""

import itertools

import pytest
import torch

from torchtitan_seq1f1b import SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import TinyTransformerArgs

from tests.harness import Case, pipelined, pipelined_cases, reference, run_ranks

SEQ_LEN = 30  # balanced plans of the tiny model are uneven from here on
RTOL, ATOL = 1e-10, 1e-14


def _plan(partition: str, num_segments: int, n_kv_heads: int) -> SegmentPlan:
    if partition == "uniform":
        return SegmentPlan.uniform(SEQ_LEN, num_segments)
    cost = TinyTransformerArgs(n_kv_heads=n_kv_heads).cost()
    return SegmentPlan.balanced(SEQ_LEN, num_segments, cost)


def _cases() -> list[Case]:
    cases = []
    for k, m, partition, n_kv_heads, ac in itertools.product(
        (1, 2, 3, 4), (1, 2, 3), ("uniform", "balanced"), (4, 2), ("none", "full")
    ):
        plan = _plan(partition, k, n_kv_heads)
        cases.append(Case(m, plan.lengths, n_kv_heads=n_kv_heads, activation_checkpoint=ac))
    # The same plan can come from both partitions; run it once.
    return list(dict.fromkeys(cases))


CASES = _cases()


def _case_id(case: Case) -> str:
    lengths = "-".join(map(str, case.lengths))
    attn = "mha" if case.n_kv_heads == 4 else "gqa"
    return f"m{case.n_microbatches}-seg{lengths}-{attn}-ac_{case.activation_checkpoint}"


@pytest.fixture(scope="module", params=[2, 4], ids=lambda pp: f"pp{pp}")
def pipeline_runs(request):
    pp = request.param
    per_rank = run_ranks(pipelined_cases, pp, CASES, timeout=900)
    return pp, {case: [rank[i] for rank in per_rank] for i, case in enumerate(CASES)}


def test_grid_covers_uneven_plans():
    uneven = [c for c in CASES if len(set(c.lengths)) > 1]
    assert {len(c.lengths) for c in uneven} >= {2, 3, 4}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_unsplit_reference(pipeline_runs, case):
    pp, runs = pipeline_runs
    ranks = runs[case]
    ref = reference(case)

    grads = {}
    for rank in ranks:
        assert not grads.keys() & rank["grads"].keys()
        grads.update(rank["grads"])
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)

    last = ranks[-1]
    assert len(last["losses"]) == case.n_microbatches
    torch.testing.assert_close(sum(last["losses"]), ref["loss_sum"], rtol=RTOL, atol=0)
    torch.testing.assert_close(last["logits"], ref["logits"], rtol=RTOL, atol=ATOL)

    chunk_lens = [[n] for n in case.lengths] * case.n_microbatches
    for index, rank in enumerate(ranks):
        has_input_recv, has_grad_recv = index > 0, index < len(ranks) - 1
        expected = chunk_lens * has_input_recv + chunk_lens * has_grad_recv
        assert [r for r in rank["recv_lens"] if r] == expected, "receive buffers not per segment"
        assert rank["kv_left_after_step"] == 0, "K/V of a microbatch outlived its backward"
        assert rank["kv_left_after_eval"] == 0, "eval() left K/V behind"
        if len(case.lengths) > 1:
            assert rank["kv_peak_bytes"] > 0


def test_external_loss_normalizer_scales_gradients():
    """``loss_normalizer`` (torchtitan's global token count) replaces the step's own."""
    case = Case(2, (12, 10, 8))
    ref = reference(case)
    valid_tokens = int((case.batch()[1] != -100).sum())
    normalizer = 3.0 * valid_tokens
    ranks = run_ranks(pipelined, 2, case, normalizer, timeout=300)
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(
                grad * 3.0, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name
            )
    torch.testing.assert_close(sum(ranks[-1]["losses"]), ref["loss_sum"], rtol=RTOL, atol=0)


def _broken_pipeline(rank, world_size, case, broken):
    """The pipeline with one half of the cross-segment machinery switched off."""
    from torchtitan_seq1f1b import kv_store

    if broken == "prefix_grads":
        kv_store._PrefixBuffers.take_grads = (
            lambda self, start, end, gk, gv: (gk[:, start:end], gv[:, start:end])
        )
    else:
        kv_store.KVStore.attach = lambda self, layer, k, v: (k, v)
    return pipelined_cases(rank, world_size, [case])[0]


@pytest.mark.parametrize("broken", ["prefix_grads", "prefix_attention"])
def test_reference_comparison_catches_broken_segment_attention(broken):
    """Negative control: the comparison above fails when segments stop seeing each other."""
    case = Case(2, (12, 10, 8))
    ref = reference(case)
    ranks = run_ranks(_broken_pipeline, 2, case, broken, timeout=300)
    worst = max(
        ((g - ref["grads"][n]).abs().max() / ref["grads"][n].abs().max()).item()
        for rank in ranks
        for n, g in rank["grads"].items()
    )
    assert worst > 1e-3

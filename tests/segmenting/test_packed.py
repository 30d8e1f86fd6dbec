# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

import dataclasses
import random

import pytest
import torch

from torchtitan_seq1f1b.segmenting import (
    DocumentLengths,
    PackedDocumentsCost,
    SegmentPlan,
    TransformerCost,
)
from torchtitan_seq1f1b.documents import keys_per_query
from torchtitan_seq1f1b.tools.documents import sample_document_ids

LLAMA3_8B = TransformerCost(
    n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
    ffn_hidden_dim=14336, vocab_size=128256, gated_mlp=True,
)
SMALL = TransformerCost(n_layers=2, dim=16, n_heads=4, n_kv_heads=2, ffn_hidden_dim=32,
                        vocab_size=50)


def imbalance(plan, cost):
    flops = plan.segment_flops(cost)
    return max(flops) * len(flops) / sum(flops)


def random_ids(rows, seq_len, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        row, doc = [], 0
        for _ in range(seq_len):
            doc += rng.random() < 0.15
            row.append(doc)
        out.append(row)
    return torch.tensor(out)


def test_keys_per_query_is_a_direct_count_of_the_document_mask():
    ids = random_ids(3, 40, seed=1)
    keys = keys_per_query(ids)
    for r in range(3):
        for t in range(40):
            allowed = sum(1 for u in range(t + 1) if ids[r, u] == ids[r, t])
            assert keys[r, t] == allowed


def test_from_keys_counts_masked_pairs_per_span():
    ids = random_ids(4, 64, seed=2)
    cost = PackedDocumentsCost.from_keys(SMALL, keys_per_query(ids))
    per_token, per_pair = SMALL.token_flops(), SMALL.pair_rates()[0]
    keys = keys_per_query(ids)
    for start, end in [(0, 64), (0, 1), (10, 37), (63, 64)]:
        pairs = int(keys[:, start:end].sum())
        assert cost.attention_flops(end - start, end) == round(per_pair * pairs / 4)
        assert cost.forward_flops(end - start, end) == (
            (end - start) * per_token + cost.attention_flops(end - start, end)
        )


def test_from_keys_caps_a_sliding_window_layers_keys():
    ids = random_ids(4, 64, seed=3)
    windowed = dataclasses.replace(SMALL, window_layers=1, window=6)
    cost = PackedDocumentsCost.from_keys(windowed, keys_per_query(ids))
    full, in_window = windowed.pair_rates()
    keys = keys_per_query(ids)
    for start, end in [(0, 64), (10, 37), (63, 64)]:
        pairs = int(keys[:, start:end].sum())
        capped = int(keys[:, start:end].clamp(max=6).sum())
        assert cost.attention_flops(end - start, end) == round((full * pairs + in_window * capped) / 4)


# 24 of its 32 layers linear attention (qwen3_5's pattern), which documents do not change.
@pytest.mark.parametrize(
    "model", [LLAMA3_8B, dataclasses.replace(LLAMA3_8B, linear_layers=24)], ids=["softmax", "linear"]
)
@pytest.mark.parametrize("k,align", [(2, 1), (4, 1), (4, 128), (7, 64), (8, 8)])
def test_one_document_is_dense_causal(k, align, model):
    seq_len = 32768
    ids = torch.full((3, seq_len), 5)
    cost = PackedDocumentsCost.from_keys(model, keys_per_query(ids))
    for length, end in [(1, 1), (6215, 32768), (777, 1000), (32768, 32768)]:
        assert cost.forward_flops(length, end) == model.forward_flops(length, end)
    expected = SegmentPlan.balanced(seq_len, k, model, align)
    assert SegmentPlan.balanced(seq_len, k, cost, align) == expected
    # A document far longer than the window is the same limit from the distribution side.
    endless = PackedDocumentsCost.expected(model, DocumentLengths.fixed(10**13), seq_len)
    assert SegmentPlan.balanced(seq_len, k, endless, align) == expected


def test_expected_keys_of_fixed_lengths_is_the_closed_form():
    # A window starting at a uniform point of length-L documents: P(A >= a) = (L - a) / L.
    length = 100
    keys = DocumentLengths.fixed(length).expected_keys(300)
    for t in (0, 1, 50, 99):
        assert keys[t] == pytest.approx((t + 1) - t * (t + 1) / (2 * length))
    # Past one document length the age no longer depends on t.
    assert keys[99] == pytest.approx(keys[299]) == pytest.approx((length + 1) / 2)


@pytest.mark.parametrize(
    "documents",
    [DocumentLengths.lognormal(2048), DocumentLengths.fixed(300),
     DocumentLengths.from_samples([1, 5, 5, 4000])],
    ids=["lognormal", "fixed", "samples"],
)
def test_flops_sum_exactly_over_any_split(documents):
    seq_len = 8192
    costs = [
        PackedDocumentsCost.expected(LLAMA3_8B, documents, seq_len),
        PackedDocumentsCost.from_keys(
            LLAMA3_8B, keys_per_query(sample_document_ids(documents, 3, seq_len))
        ),
    ]
    rng = random.Random(0)
    for cost in costs:
        whole = cost.forward_flops(seq_len, seq_len)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, 12)))
            plan = SegmentPlan.from_lengths([b - a for a, b in zip([0, *cuts], [*cuts, seq_len])])
            assert sum(plan.segment_flops(cost)) == whole


@pytest.mark.parametrize("mean", [1, 16])
def test_very_short_documents_give_uniform_plans(mean):
    documents = DocumentLengths.fixed(1) if mean == 1 else DocumentLengths.lognormal(mean)
    cost = PackedDocumentsCost.expected(LLAMA3_8B, documents, 32768)
    for k in (2, 4, 8):
        plan = SegmentPlan.balanced(32768, k, cost)
        if mean == 1:
            assert plan == SegmentPlan.uniform(32768, k)
        else:
            assert max(abs(n - 32768 // k) for n in plan.lengths) <= 0.005 * 32768 // k


@pytest.mark.parametrize("k", [2, 4, 8])
def test_balanced_equalises_document_masked_flops(k):
    seq_len = 32768
    cost = PackedDocumentsCost.expected(LLAMA3_8B, DocumentLengths.lognormal(2048), seq_len)
    plan = SegmentPlan.balanced(seq_len, k, cost)
    causal = SegmentPlan.balanced(seq_len, k, LLAMA3_8B)
    uniform = SegmentPlan.uniform(seq_len, k)
    assert imbalance(plan, cost) < 1.001
    # A plan balanced for dense causal attention front-loads tokens the mask makes cheap.
    assert imbalance(causal, cost) > imbalance(uniform, cost) > imbalance(plan, cost)
    assert plan.lengths[0] < causal.lengths[0]


def test_expected_cost_matches_sampled_windows():
    documents = DocumentLengths.lognormal(256)
    seq_len = 2048
    expected = PackedDocumentsCost.expected(SMALL, documents, seq_len)
    sampled = PackedDocumentsCost.from_keys(
        SMALL, keys_per_query(sample_document_ids(documents, 2000, seq_len, seed=3))
    )
    for start, end in [(0, 256), (256, 1024), (1024, 2048)]:
        assert sampled.attention_flops(end - start, end) == pytest.approx(
            expected.attention_flops(end - start, end), rel=0.05
        )


def test_lognormal_is_deterministic_with_the_given_mean():
    documents = DocumentLengths.lognormal(2048)
    assert documents == DocumentLengths.lognormal(2048)
    assert documents.mean == pytest.approx(2048, abs=0.5)
    assert DocumentLengths.parse("lognormal:2048") == documents
    assert DocumentLengths.parse("lognormal:2048:0.5") == DocumentLengths.lognormal(2048, 0.5)
    assert DocumentLengths.parse("fixed:64") == DocumentLengths.fixed(64)
    median = sorted(documents.lengths)[len(documents.lengths) // 2]
    assert median < 0.6 * 2048 < 4 * 2048 < max(documents.lengths)  # long-tailed


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: DocumentLengths((), ()), "non-empty"),
        (lambda: DocumentLengths((0, 4), (0.5, 0.5)), "positive ints"),
        (lambda: DocumentLengths((4, 4), (0.5, 0.5)), "distinct"),
        (lambda: DocumentLengths((4, 8), (0.5,)), "1 probabilities for 2 lengths"),
        (lambda: DocumentLengths((4, 8), (0.5, 0.6)), "normalise"),
        (lambda: DocumentLengths((4, 8), (1.0, 0.0)), "positive and finite"),
        (lambda: DocumentLengths.from_samples([]), "at least one"),
        (lambda: DocumentLengths.lognormal(0), "mean=0"),
        (lambda: DocumentLengths.lognormal(100, sigma=-1), "sigma=-1"),
        (lambda: DocumentLengths.parse("pareto:2048"), "expected lognormal:MEAN"),
        (lambda: DocumentLengths.parse("fixed:1.5"), "expected lognormal:MEAN"),
        (lambda: DocumentLengths.parse("lognormal:abc"), "documents 'lognormal:abc'"),
        (lambda: DocumentLengths.fixed(8).expected_keys(0), "seq_len=0"),
        (lambda: keys_per_query(torch.tensor([[0, 1, 0]])), "non-decreasing"),
        (lambda: keys_per_query(torch.zeros(2, 3)), "integer tensor"),
        (lambda: keys_per_query(torch.zeros(3, dtype=torch.long)), "(batch, seq_len)"),
        (lambda: PackedDocumentsCost(SMALL, (1, 2)), "starting at 0"),
        (lambda: PackedDocumentsCost(SMALL, (0, 5, 3)), "non-decreasing"),
        (lambda: PackedDocumentsCost.from_keys(SMALL, keys_per_query(torch.zeros(1, 8, dtype=torch.long)))
         .forward_flops(4, 9), "past this cost's seq_len=8"),
        (lambda: SegmentPlan.balanced(
            16, 2, PackedDocumentsCost.from_keys(SMALL, keys_per_query(torch.zeros(1, 8, dtype=torch.long)))),
         "built for seq_len=8"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

import json
import subprocess
import sys

import pytest
import torch

from torchtitan_seq1f1b.segmenting import DocumentLengths, SegmentPlan
from torchtitan_seq1f1b.tools.documents import (
    attention_pairs_per_segment,
    kv_rows_kept,
    rank_kv_peak_rows,
    sample_document_ids,
)
from torchtitan_seq1f1b.tools.documents.cli import main as report_main
from torchtitan_seq1f1b.tools.model_shapes import get_preset
from torchtitan_seq1f1b.tools.simulate import main, SimConfig, simulate, unit_times

LOGNORMAL = DocumentLengths.lognormal(256)


def test_sampled_ids_are_packed_windows_and_reproducible():
    ids = sample_document_ids(LOGNORMAL, 300, 2048, seed=7)
    assert ids.shape == (300, 2048) and ids.dtype == torch.int64
    assert torch.equal(ids, sample_document_ids(LOGNORMAL, 300, 2048, seed=7))
    assert not torch.equal(ids, sample_document_ids(LOGNORMAL, 300, 2048, seed=8))
    assert (ids[:, 0] == 0).all() and (ids[:, 1:] >= ids[:, :-1]).all()
    steps = ids[:, 1:] - ids[:, :-1]
    assert steps.max() == 1
    # About seq_len / mean document starts per window.
    assert ids[:, -1].float().mean() == pytest.approx(2048 / 256, rel=0.1)


def test_attention_pairs_per_segment():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    plan = SegmentPlan.from_lengths([2, 3, 3])
    pairs = attention_pairs_per_segment(ids, plan)
    # Row 0 keys per query: 1 2 3 1 2 3 4 1; row 1: 1..8.
    assert pairs == [(3 + 3, 2 * 3), (3 + 1 + 2 + 12, 2 * 12), (3 + 4 + 1 + 21, 2 * 21)]
    one_document = torch.zeros(2, 8, dtype=torch.long)
    assert all(m == d for m, d in attention_pairs_per_segment(one_document, plan))


def test_kv_rows_kept_starts_at_the_first_key_read_back():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 2, 2]])
    assert kv_rows_kept(ids[:1], SegmentPlan.from_lengths([4, 4])) == 8 - 3
    assert kv_rows_kept(ids[:1], SegmentPlan.from_lengths([2, 3, 3])) == 8
    assert kv_rows_kept(ids[1:], SegmentPlan.from_lengths([4, 4])) == 8 - 1
    assert kv_rows_kept(ids, SegmentPlan.from_lengths([4, 4])) == 8 - 1  # min over rows
    # segment 1 starts a document: it reads nothing back, nothing is kept
    assert kv_rows_kept(ids[:1], SegmentPlan.from_lengths([7, 1])) == 0
    with pytest.raises(ValueError, match="num_segments >= 2"):
        kv_rows_kept(ids, SegmentPlan.from_lengths([8]))


@pytest.mark.parametrize("p,m,k,live", [(4, 8, 4, 3), (4, 8, 1, 4), (2, 4, 2, 2), (4, 8, 8, 3)])
def test_rank0_kv_peak_counts_the_microbatches_the_simulator_holds(p, m, k, live):
    assert rank_kv_peak_rows([100] * m, p, k) == live * 100
    model = get_preset("paper-7b")
    config = SimConfig(model=model, seq_len=4096, pp=p, microbatches=m, segments=k,
                       partition="uniform")
    if k > 1:  # the simulator's K/V peak: whole-sequence K/V per microbatch, plus a grad bank
        rank0 = simulate(config).ranks[0].peak_kv_bytes
        kv = live * 4096 * 2 * model.kv_dim * 2 * (model.n_layers // p)
        assert kv <= rank0 < kv * (1 + 2 / live)
    kept = list(range(1, m + 1))
    assert rank_kv_peak_rows(kept, p, k) <= sum(sorted(kept)[-live:])


def test_report_prints_both_tables(capsys):
    assert report_main(["--seq-len", "4096", "--documents", "lognormal:256", "-k", "1", "4",
                        "--steps", "2", "-m", "4", "--micro-batch-size", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 4 | balanced |" in out and "| 4 | causal-balanced | 2 |" in out
    assert "| 1 | uniform | [4096] |" in out and "| 1 | uniform | 1 |" not in out  # no store
    rows = [line for line in out.splitlines() if line.startswith("| 4 | balanced | 1 |")]
    kept, ratio = rows[0].split(" | ")[3], float(rows[0].split(" | ")[-1].rstrip(" |"))
    assert 0.75 <= float(kept.split()[0]) <= 1 and 0 < ratio <= 1


def test_report_rejects_bad_documents(capsys):
    with pytest.raises(SystemExit):
        report_main(["--documents", "zipf:3"])
    assert "expected lognormal:MEAN" in capsys.readouterr().err


def _doc_config(partition, **kwargs):
    return SimConfig(model=get_preset("llama3-8b"), seq_len=32768, pp=4, microbatches=8,
                     segments=4, partition=partition, documents=DocumentLengths.lognormal(2048),
                     documents_name="lognormal:2048", **kwargs)


def test_simulator_prices_units_with_the_document_mask():
    balanced = simulate(_doc_config("balanced"))
    causal = simulate(_doc_config("causal-balanced"))
    uniform = simulate(_doc_config("uniform"))
    assert balanced.segment_flops_imbalance < 1.001
    assert causal.segment_flops_imbalance > uniform.segment_flops_imbalance > 1.01
    assert balanced.makespan < uniform.makespan < causal.makespan
    assert balanced.bubble_fraction < causal.bubble_fraction
    dense = SimConfig(model=get_preset("llama3-8b"), seq_len=32768, pp=4, microbatches=8,
                      segments=4, partition="balanced")
    assert causal.segment_lengths == dense.plan().lengths
    times = unit_times(_doc_config("balanced", backward_split="flops"),
                       _doc_config("balanced").plan())
    assert sum(times["F"]) == pytest.approx(1)
    # Weight gradients are the matmuls: the same per token, with or without documents.
    assert times["W"][0] / 8567 == pytest.approx(times["W"][-1] / 7981)


def test_cli_documents_compares_plans(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["--documents", "lognormal:2048", "--schedule", "Seq1F1B", "1F1B",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("documents=lognormal:2048")
    assert "segment plans under packed documents lognormal:2048" in out
    for partition in ("uniform", "causal-balanced", "balanced"):
        assert f"Seq1F1B   4 {partition}" in out
    records = json.loads(path.read_text())
    assert len(records) == 2 + 3
    assert records[0]["config"]["documents"]["name"] == "lognormal:2048"
    assert records[-1]["segment_flops_imbalance"] < 1.001


def test_cli_output_without_documents_has_no_document_keys(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["--schedule", "Seq1F1B", "--json", str(path)]) == 0
    assert "documents" not in capsys.readouterr().out
    (record,) = json.loads(path.read_text())
    assert "documents" not in record["config"] and "segment_flops_imbalance" not in record


def test_cli_bad_documents(capsys):
    with pytest.raises(SystemExit):
        main(["--documents", "lognormal:0"])
    assert "mean=0.0 must be a finite number >= 1" in capsys.readouterr().err


def test_report_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_seq1f1b.tools.documents", "--seq-len", "2048",
         "-k", "2", "--steps", "1", "-m", "2", "--micro-batch-size", "1"],
        check=True, capture_output=True, text=True,
    ).stdout
    assert "K/V store" in out

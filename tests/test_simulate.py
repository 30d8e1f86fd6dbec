# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The pipeline simulator: bubbles, activation peaks, the paper's memory figure, the CLI."""

import json
import subprocess
import sys

import pytest

from torchtitan_seq1f1b import seq1f1b_order, validate_order
from torchtitan_seq1f1b.model_presets import MODEL_PRESETS, get_preset
from torchtitan_seq1f1b.simulate import (
    PAPER_CONFIGS,
    MemoryModel,
    SimConfig,
    analytic_bubble,
    gpipe_order,
    main,
    run_paper,
    simulate,
    simulate_timeline,
)

TOLERANCE = 0.08
SMALL = get_preset("paper-7b")


def _config(schedule, p, m, k=4, partition="uniform", **kwargs):
    return SimConfig(
        model=SMALL, seq_len=4096, pp=p, microbatches=m, segments=k,
        schedule=schedule, partition=partition, **kwargs,
    )


# ---- timeline ---------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,k", [(1, 3, 2), (2, 2, 1), (4, 8, 4), (4, 2, 4), (8, 16, 4), (3, 5, 3)]
)
def test_equal_cost_units_reproduce_the_analytic_bubble(p, m, k):
    order = seq1f1b_order(p, m, k)
    timeline = simulate_timeline(order, lambda a: (1 if a.kind == "F" else 2) / k)
    assert timeline.bubble_fraction == pytest.approx(analytic_bubble(p, m, k), abs=1e-12)
    assert timeline.makespan == pytest.approx((m * k + p - 1) * 3 / k, abs=1e-12)


@pytest.mark.parametrize("schedule,k", [("1F1B", 1), ("GPipe", 1), ("Seq1F1B", 4)])
def test_reported_equal_cost_bubble_is_the_analytic_one(schedule, k):
    result = simulate(_config(schedule, p=4, m=8, k=4, partition="balanced"))
    assert result.config.num_segments == k
    assert result.analytic_bubble_fraction == pytest.approx((4 - 1) / (8 * k + 4 - 1))
    assert result.equal_cost_bubble_fraction == pytest.approx(result.analytic_bubble_fraction)


def test_one_f_one_b_bubble_needs_no_equal_cost_assumption():
    # A whole microbatch is the unit: every unit costs the same by construction.
    result = simulate(_config("1F1B", p=4, m=16))
    assert result.makespan == pytest.approx(57.0)  # (m + p - 1) * (F + B)
    assert result.bubble_fraction == pytest.approx(3 / 19)


def test_balanced_partition_beats_even_split_on_causal_costs():
    # Design note anchor: 7B, 32k, p=4, m=16: even split is worse than 1F1B, balanced better.
    base = dict(model=SMALL, seq_len=32768, pp=4, microbatches=16, segments=4, schedule="Seq1F1B")
    even = simulate(SimConfig(partition="uniform", **base)).makespan
    balanced = simulate(SimConfig(partition="balanced", **base)).makespan
    assert balanced == pytest.approx(50.25, abs=0.02)
    assert 63.5 < even < 64.5
    assert balanced < 57.0 < even


def test_p2p_latency_lengthens_the_step():
    without = simulate(_config("Seq1F1B", p=4, m=4)).makespan
    with_latency = simulate(_config("Seq1F1B", p=4, m=4, p2p_latency=0.1)).makespan
    assert with_latency > without


def test_gpipe_order_is_valid():
    for p, m, k in [(1, 1, 1), (2, 3, 1), (3, 2, 2), (4, 4, 1)]:
        validate_order(gpipe_order(p, m, k), p, m, k)


# ---- memory -----------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,k", [(1, 2, 2), (2, 4, 2), (4, 8, 4), (4, 4, 2), (8, 8, 4), (4, 6, 8)]
)
def test_rank0_activation_peak_in_microbatches(p, m, k):
    seq = simulate(_config("Seq1F1B", p, m, k))
    one_f_one_b = simulate(_config("1F1B", p, m))
    assert seq.ranks[0].peak_activation_microbatches == pytest.approx(min(m * k, p + k - 1) / k)
    assert one_f_one_b.ranks[0].peak_activation_microbatches == pytest.approx(min(m, p))


def test_gpipe_holds_every_microbatch():
    result = simulate(_config("GPipe", p=4, m=6))
    assert result.ranks[0].peak_activation_microbatches == pytest.approx(6)


def test_balanced_split_raises_the_peak_a_little():
    # Design note: ~1.93 microbatches at 32k (p=4, k=4) instead of 1.75 for an even split.
    cfg = dict(model=SMALL, seq_len=32768, pp=4, microbatches=8, schedule="Seq1F1B")
    balanced = simulate(SimConfig(partition="balanced", **cfg)).ranks[0]
    assert 1.85 < balanced.peak_activation_microbatches < 2.0


def test_activation_formula_is_korthikanti_34_for_gpt_shapes():
    # Last stage excluded (it also holds the loss softmax); b=1, tp=1.
    cfg = SimConfig(model=SMALL, seq_len=2048, pp=2, microbatches=1, schedule="1F1B")
    rank0 = simulate(cfg).ranks[0]
    s, h, layers = 2048, SMALL.dim, SMALL.n_layers // 2
    assert rank0.peak_activation_bytes == s * h * 34 * layers
    eager = simulate(SimConfig(model=SMALL, seq_len=2048, pp=2, microbatches=1, schedule="1F1B",
                               memory=MemoryModel(attention="eager"))).ranks[0]
    a = SMALL.n_heads
    assert eager.peak_activation_bytes == s * h * (34 + 5 * a * s / h) * layers
    # Sequence parallel divides everything by tp; without it, only 24 of the 34.
    tp = 8
    sp = simulate(SimConfig(model=SMALL, seq_len=2048, pp=2, tp=tp, microbatches=1,
                            schedule="1F1B")).ranks[0]
    no_sp = simulate(SimConfig(
        model=SMALL, seq_len=2048, pp=2, tp=tp, microbatches=1, schedule="1F1B",
        memory=MemoryModel(sequence_parallel=False),
    )).ranks[0]
    assert sp.peak_activation_bytes == s * h * 34 / tp * layers
    assert no_sp.peak_activation_bytes == s * h * (10 + 24 / tp) * layers


def test_model_states_are_18_bytes_per_param_and_dp_shards_the_optimizer():
    cfg = dict(model=SMALL, seq_len=1024, pp=4, microbatches=4, schedule="1F1B", tp=2)
    plain = simulate(SimConfig(dp=4, **cfg)).ranks[1]
    sharded_memory = MemoryModel(distributed_optimizer=True)
    sharded = simulate(SimConfig(dp=4, memory=sharded_memory, **cfg)).ranks[1]
    params = 8 * SMALL.layer_params(2)
    assert plain.model_state_bytes == 18 * params
    assert sharded.model_state_bytes == 6 * params + 12 * params // 4


def test_kv_store_only_for_segments():
    assert simulate(_config("1F1B", p=4, m=4)).ranks[0].peak_kv_bytes == 0
    assert simulate(_config("Seq1F1B", p=4, m=4)).ranks[0].peak_kv_bytes > 0


def test_presets_have_the_expected_sizes():
    expected = {
        "paper-2.7b": (2.5, 3.0), "paper-7b": (6.5, 7.2), "paper-13b": (12.5, 13.5),
        "paper-30b": (29, 31), "llama3-8b": (7.8, 8.2), "llama3-70b": (69, 72),
    }
    assert expected.keys() == MODEL_PRESETS.keys()
    for name, (low, high) in expected.items():
        shape = MODEL_PRESETS[name]
        total = (shape.n_layers * shape.layer_params(1) + 2 * shape.embedding_params(1)) / 1e9
        assert low < total < high, name


# ---- the paper ----------------------------------------------------------------


def test_paper_ratios_within_tolerance():
    records = run_paper()
    assert {r["config"] for r in records} == {c.label for c in PAPER_CONFIGS}
    for rec in records:
        assert abs(rec["predicted_ratio"] - rec["published_ratio"]) <= TOLERANCE, rec
        assert rec["predicted_gb"] > 0


# ---- command line ---------------------------------------------------------------


def test_cli_json_records(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["--model", "llama3-8b", "--seq-len", "8192", "--pp", "4", "--tp", "2",
                 "-m", "8", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["schedule"] for r in records] == ["1F1B", "GPipe", "Seq1F1B"]
    for rec in records:
        assert {"schedule", "makespan", "bubble_fraction", "peak_memory_bytes",
                "analytic_bubble_fraction", "equal_cost_bubble_fraction"} <= rec.keys()
        assert len(rec["peak_memory_bytes"]) == 4
        assert all(isinstance(b, int) and b > 0 for b in rec["peak_memory_bytes"])
    assert "Seq1F1B" in capsys.readouterr().out


def test_cli_paper_json(tmp_path, capsys):
    path = tmp_path / "paper.json"
    assert main(["--paper", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert len(records) == 2 * len(PAPER_CONFIGS)
    for rec in records:
        assert {"config", "schedule", "predicted_gb", "published_gb"} <= rec.keys()
    assert "7B 32xGPU 32k" in capsys.readouterr().out


def test_cli_explicit_dims_and_schedule_names(capsys):
    assert main(["--layers", "8", "--dim", "512", "--heads", "8", "--kv-heads", "2",
                 "--seq-len", "1024", "--pp", "2", "-m", "4", "--schedule", "seq1f1b", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "Seq1F1B" in out and "1F1B" in out and "GPipe" not in out


@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "1024", "--pp", "2", "-m", "4"], "give --model or all of"),
    (["--model", "paper-7b", "--pp", "2", "-m", "4"], "--seq-len"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "0", "-m", "4"], "positive integer"),
    (["--model", "paper-7b", "--seq-len", "x", "--pp", "2", "-m", "4"], "positive integer"),
    (["--model", "gpt-5", "--seq-len", "1024", "--pp", "2", "-m", "4"], "invalid choice"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--schedule", "zb"],
     "unknown schedule"),
    (["--model", "paper-7b", "--layers", "4", "--seq-len", "1024", "--pp", "2", "-m", "4"],
     "not both"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "64", "-m", "4"], "exceeds"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "--tp", "3", "-m", "4"],
     "does not divide"),
    (["--model", "paper-7b", "--seq-len", "1004", "--pp", "2", "--tp", "8", "-m", "4"],
     "multiple of align"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--v", "2"],
     "interleaved"),
    (["--model", "paper-7b", "--seq-len", "1024", "--pp", "2", "-m", "4", "--p2p-latency", "-1"],
     "number >= 0"),
    (["--layers", "4", "--dim", "100", "--heads", "3", "--seq-len", "64", "--pp", "2", "-m", "2"],
     "not divisible"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_seq1f1b.simulate", "--paper"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "30B 64xGPU 32k" in result.stdout

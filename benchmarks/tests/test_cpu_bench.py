# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The CPU benchmark: a --quick run's records, and bad options rejected before any spawn.

Timings depend on the machine; only their shape and sanity are checked here.
Memory is exact: measured ratios must follow the simulator's, and with k = 1
Seq1F1B must hold what torch's schedule with the same order holds.
"""

import dataclasses
import json
import os
import platform
import subprocess
import sys

import pytest

from torchtitan_seq1f1b.planner import segment_plan
import benchmarks.cpu_bench as bench
from benchmarks.cpu_bench import cli as bench_cli, runner
from benchmarks.cpu_bench.auto import auto_row, calibrate_bench_model
from benchmarks.cpu_bench.predict import ratio_spread
from benchmarks.cpu_bench.table import noise_summary

REQUIRED_KEYS = {
    "schedule", "pp", "microbatches", "segments", "partition", "step_time_s",
    "peak_activation_bytes", "bubble_fraction", "model", "steps", "actions",
}


@pytest.fixture(scope="module")
def quick_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _row(records, schedule, segments=1):
    return next(r for r in records if r["schedule"] == schedule and r["segments"] == segments)


def test_quick_records_are_complete_and_sane(quick_records):
    assert {r["schedule"] for r in quick_records} == set(bench.SCHEDULES)
    for record in quick_records:
        assert REQUIRED_KEYS <= record.keys(), record["label"]
        assert record["step_time_s"] > 0
        assert len(record["peak_activation_bytes"]) == record["pp"] == 2
        assert all(peak > 0 for peak in record["peak_activation_bytes"])
        assert 0 <= record["bubble_fraction"] < 1
        kinds = {a["kind"] for a in record["actions"]}
        assert {"F"} < kinds, record["label"]
        assert all(a["end"] >= a["start"] >= 0 for a in record["actions"])


def test_every_row_reports_how_far_its_step_ratios_stray(quick_records):
    for record in quick_records:
        assert len(record["step_time_ratios"]) == record["steps"] == 2, record["label"]
        assert record["step_time_ratio_spread"] >= 0, record["label"]
    assert _row(quick_records, "1F1B")["step_time_ratio_spread"] == 0


def test_ratio_spread_is_half_the_interquartile_range():
    assert ratio_spread([1.0, 1.1, 0.9, 1.0, 1.05]) == pytest.approx(0.025)
    assert ratio_spread([0.8, 1.0]) == pytest.approx(0.05)
    assert ratio_spread([0.9]) is None


def test_noise_summary_leaves_out_the_baseline_and_untimed_rows():
    records = [
        {"schedule": "1F1B", "step_time_ratio_spread": 0.0},
        {"schedule": "Seq1F1B", "step_time_ratio_spread": 0.02},
        {"schedule": "Seq1F1B", "step_time_ratio_spread": 0.06},
        {"schedule": "Seq1F1B", "step_time_ratio_spread": 0.04},
        {"schedule": "GPipe", "step_time_ratio_spread": None},
    ]
    summary = noise_summary(records)
    assert "+-4.0% around its median" in summary and "widest +-6.0%" in summary
    assert noise_summary(records[:1] + records[-1:]) is None


def test_quick_seq1f1b_holds_less_on_rank_0_than_1f1b(quick_records):
    one_f_one_b = _row(quick_records, "1F1B")
    seq1f1b = _row(quick_records, "Seq1F1B", segments=4)
    assert seq1f1b["peak_activation_bytes"][0] < one_f_one_b["peak_activation_bytes"][0]
    assert seq1f1b["peak_kv_store_bytes"][0] > 0
    assert one_f_one_b["peak_activation_ratio"] == 1.0
    assert 0 < seq1f1b["predicted"]["peak_activation_ratio"] < 1


# measured / predicted rank-0 activation ratio (both against 1F1B), per
# placement: the simulator counts Korthikanti's bf16 per-token constants, the
# bench fp32 tensors, and it over-predicts the V (rank 0 holds the embedding,
# the LM head and the loss).
PREDICTION_BOUNDS = {"loop": (0.85, 1.05), "v": (0.7, 1.0)}


def test_measured_memory_ratios_follow_the_simulator(quick_records):
    for record in quick_records:
        assert record["predicted"] is not None, record["label"]
        measured = record["peak_activation_ratio"]
        predicted = record["predicted"]["peak_activation_ratio"]
        low, high = PREDICTION_BOUNDS[record["placement"]]
        assert low <= measured / predicted <= high, (record["label"], measured, predicted)


@pytest.mark.parametrize(
    "seq1f1b,torch_schedule", [("Seq1F1B", "1F1B"), ("InterleavedSeq1F1B", "Interleaved1F1B")]
)
def test_k1_holds_what_torch_holds_with_the_same_order(quick_records, seq1f1b, torch_schedule):
    """With k = 1 the K/V store holds the K/V attention would have saved: every
    rank's measured peak (saved tensors + store) equals torch's to the byte."""
    k1, reference = _row(quick_records, seq1f1b), _row(quick_records, torch_schedule)
    assert all(kv > 0 for kv in k1["peak_kv_store_bytes"])
    assert k1["peak_activation_bytes"] == reference["peak_activation_bytes"]


def test_seq1f1b_k1_runs_the_same_order_as_1f1b(quick_records):
    one_f_one_b, k1 = _row(quick_records, "1F1B"), _row(quick_records, "Seq1F1B")
    per_rank = [
        [(a["kind"], a["microbatch"]) for a in sorted(r["actions"], key=lambda a: a["start"])
         if a["rank"] == rank]
        for r in (one_f_one_b, k1)
        for rank in (0, 1)
    ]
    assert per_rank[:2] == per_rank[2:]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pp", "3"], "--layers 4 does not split into the 3 equal stages"),
        (["-k", "3"], "--segments 3 does not divide --seq-len 512"),
        (["-m", "0"], "argument --microbatches/-m: expected a positive integer, got 0"),
        (["-m", "1"], "1F1B needs microbatches >= pp (1 < 2)"),
        (["--pp", "1"], "--pp 1: a pipeline needs at least 2 ranks"),
        (["--heads", "3", "--kv-heads", "3"], "dim=128 is not divisible by n_heads=3"),
        (["--auto", "--no-calibrate"], "--auto and --partitions time need the calibration"),
        (["--memory-budget-gib", "1"], "--memory-budget-gib bounds the --auto pick; add --auto"),
        (["--cp", "1"], "argument --cp: expected an integer >= 2, got 1"),
        (["--cp", "2", "--auto", "--compile"], "--cp runs its own rows (1F1B and uniform "
         "Seq1F1B); leave out --auto --compile"),
        (["--cp", "2", "-k", "3"], "--seq-len 512 does not split into 3 segments of a multiple "
         "of 2 * cp = 4 tokens"),
    ],
)
def test_bad_options_fail_before_any_rank_starts(argv, message, monkeypatch, capsys):
    def must_not_spawn(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(runner, "run_ranks", must_not_spawn)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_simulated_row_gets_a_calibrated_prediction(quick_records):
    for record in quick_records:
        if record["predicted"] is None:
            continue
        calibrated = record["calibrated"]
        assert calibrated["step_seconds"] > 0, record["label"]
        assert len(calibrated["peak_bytes"]) == record["pp"]
        assert "step_time_ratio" in calibrated
    assert _row(quick_records, "1F1B")["calibrated"]["step_time_ratio"] == 1.0


def test_auto_rows_run_the_planners_pick(tmp_path):
    path = tmp_path / "auto.json"
    argv = [
        "--quick", "--schedules", "1F1B", "Seq1F1B", "-k", "1", "2", "--partitions", "time",
        "--auto", "--steps", "1", "--warmup-steps", "0", "--json", str(path),
    ]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    config, _ = bench_cli._config_from_args(bench_cli._parser(), bench_cli._parser().parse_args(argv))
    time_model, _ = calibrate_bench_model(config)  # the cache the run wrote
    config = dataclasses.replace(config, time_model=time_model)
    picked = [r for r in records if r["auto"]]
    assert len(picked) == 1
    row, recommendation = auto_row(config, "Seq1F1B", 2, None)
    assert (picked[0]["segments"], picked[0]["partition"]) == (row.segments, row.partition)
    assert picked[0]["segment_lengths"] == list(recommendation.best.plan.lengths)
    timed = next(r for r in records if r["partition"] == "time" and not r["auto"])
    assert timed["segment_lengths"] == list(
        segment_plan("time", 512, 2, config.model.cost(), time_model, 4).lengths
    )


_FREED_RSS_SCRIPT = """
import os, sys, torch
from benchmarks.cpu_bench import runner
if sys.argv[1] == "keep":
    runner._keep_freed_memory_mapped()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
block = torch.ones(4 * 2**20)  # 16 MiB, touched
del block
print(rss() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_bench_ranks_keep_freed_pages_for_the_next_row():
    """A row after one that freed memory finds the pages still mapped, as a job's next step does."""

    def freed_rss(mode: str) -> int:
        # glibc's defaults, whatever the environment tunes.
        env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
        done = subprocess.run(
            [sys.executable, "-c", _FREED_RSS_SCRIPT, mode], capture_output=True, text=True,
            timeout=120, check=True, env=env,
        )
        return int(done.stdout.split()[-1])

    assert freed_rss("default") < 2**20  # glibc unmapped the freed block
    assert freed_rss("keep") > 15 * 2**20

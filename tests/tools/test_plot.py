# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every chart of ``python -m torchtitan_seq1f1b.plot`` writes a PNG."""

import json

import pytest

from torchtitan_seq1f1b.tools import plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # more than an empty canvas


def _bench_record(schedule, segments, partition, step_time, peak, bubble):
    """A record shaped like ``bench --json`` output (two ranks, m = 2)."""
    actions = [
        {"rank": rank, "stage": rank, "kind": kind, "microbatch": i, "segment": j,
         "start": start + rank * 0.01, "end": start + rank * 0.01 + 0.008}
        for rank in (0, 1)
        for start, (kind, i, j) in zip(
            [0.02 * n for n in range(4 * segments)],
            [("F", i, j) for i in range(2) for j in range(segments)]
            + [("B", i, j) for i in range(2) for j in reversed(range(segments))],
        )
    ]
    return {
        "schedule": schedule, "label": schedule if partition is None else f"{schedule} k={segments}", "pp": 2, "microbatches": 2,
        "segments": segments, "partition": partition, "step_time_s": step_time,
        "peak_activation_bytes": [peak, peak // 2], "bubble_fraction": bubble,
        "step_time_ratio": step_time, "peak_activation_ratio": peak / 100,
        "model": {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_hidden_dim": 128, "vocab_size": 256, "seq_len": 256},
        "actions": actions,
    }


@pytest.fixture
def bench_json(tmp_path):
    records = [
        _bench_record("1F1B", 1, None, 1.0, 100, 0.3),
        _bench_record("Seq1F1B", 1, "uniform", 1.0, 100, 0.3),
        _bench_record("Seq1F1B", 4, "balanced", 0.8, 70, 0.1),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(records))
    return path


@pytest.mark.parametrize(
    "schedule,extra",
    [
        ("Seq1F1B", ["-k", "4"]),
        ("1F1B", []),
        ("InterleavedSeq1F1B", ["-k", "2"]),
        ("ZBVZeroBubble", ["-m", "4"]),
        ("Seq1F1BZeroBubble", ["-k", "2"]),
    ],
)
def test_simulated_timeline(tmp_path, schedule, extra):
    out = tmp_path / "timeline.png"
    assert plot.main(["timeline", "--schedule", schedule, "--pp", "2", *extra, "-o", str(out)]) == 0
    _assert_png(out)


def test_measured_timeline(tmp_path, bench_json):
    out = tmp_path / "measured.png"
    argv = ["timeline", "--bench", str(bench_json), "--schedule", "Seq1F1B", "-k", "4"]
    assert plot.main([*argv, "-o", str(out)]) == 0
    _assert_png(out)


@pytest.mark.parametrize("with_bench", [False, True])
def test_sweep(tmp_path, bench_json, with_bench):
    out = tmp_path / "sweep.png"
    argv = ["sweep", "-k", "1", "2", "4", "-o", str(out)]
    assert plot.main(argv + (["--bench", str(bench_json)] if with_bench else [])) == 0
    _assert_png(out)


def test_missing_bench_row_names_what_the_file_holds(tmp_path, bench_json, capsys):
    with pytest.raises(SystemExit):
        plot.main(["timeline", "--bench", str(bench_json), "--schedule", "GPipe",
                   "-o", str(tmp_path / "x.png")])
    assert "it holds: 1F1B m=2, Seq1F1B k=1 m=2, Seq1F1B k=4 m=2" in capsys.readouterr().err


def test_timeline_says_what_it_simulates(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert plot.main(["timeline", "--pp", "4", "-m", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(
        "simulated: model bench (dim 256, 8 layers, 8 heads, 2 K/V heads), seq_len 1024, pp 4, m 2\n"
        "Seq1F1B, k 4 (balanced), v 1\n"
    )
    assert plot.main(["timeline", "--model", "llama3-8b", "--seq-len", "8192", "-o", str(out)]) == 0
    assert "model llama3-8b (dim 4096, 32 layers, 32 heads, 8 K/V heads), seq_len 8192, pp 2" in (
        capsys.readouterr().out
    )

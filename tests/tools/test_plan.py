# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan``: its recommendation, and bad options refused before timing."""

import json

import pytest

from torchtitan_seq1f1b.integration import titan_release
from torchtitan_seq1f1b.tools.plan import cli

TINY = ["--layers", "4", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "64",
        "--vocab", "64", "--seq-len", "128", "--pp", "2", "-m", "2", "--threads", "1"]


def test_recommends_the_fastest_plan_and_prints_its_job_config(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert cli.main([*TINY, "--json", str(path), "--attention-backend", "sdpa"]) == 0
    out = capsys.readouterr().out
    records = json.loads(path.read_text())
    chosen = [r for r in records if r["chosen"]]
    assert len(chosen) == 1
    assert chosen[0]["step_seconds"] == min(r["step_seconds"] for r in records if r["fits_budget"])
    assert f"k={chosen[0]['num_segments']} {chosen[0]['partition']}" in out
    if titan_release() == "0.3":  # the flags of a 0.3 job, without a config to repeat
        assert out.splitlines()[-1].startswith(
            "--parallelism.pipeline_parallel_schedule 1F1B --seq1f1b.schedule Seq1F1B "
            f"--seq1f1b.num_segments {chosen[0]['num_segments']} "
        )
    else:
        assert 'pipeline_parallel_schedule = "Seq1F1B"' in out and "[seq1f1b]" in out
    assert {r["num_segments"] for r in records} == set(range(1, 17))


def test_a_budget_leaves_out_the_plans_it_cannot_hold(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert cli.main([*TINY, "--json", str(path), "--max-segments", "4"]) == 0
    records = json.loads(path.read_text())
    peaks = sorted(max(r["peak_bytes"]) for r in records)
    budget_gib = (peaks[0] + peaks[-1]) / 2 / 2**30
    assert cli.main([*TINY, "--json", str(path), "--max-segments", "4",
                     "--memory-budget-gib", str(budget_gib)]) == 0
    bounded = json.loads(path.read_text())
    assert any(not r["fits_budget"] for r in bounded)
    chosen = next(r for r in bounded if r["chosen"])
    assert max(chosen["peak_bytes"]) <= budget_gib * 2**30
    assert "over the budget" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (TINY[12:], "give a model: --job-config (a torchtitan job config), --model NAME, or --layers"),
        (TINY[:12], "give --seq-len, --pp, --microbatches (or a --job-config that has them)"),
        ([*TINY, "--schedule", "Seq1F1BZBV", "-v", "1"], "Seq1F1BZBV runs between 2 and 2 stages"),
        ([*TINY, "--schedule", "InterleavedSeq1F1B", "-v", "4"], "exceeds the model's 4 blocks"),
        ([*TINY, "--align", "5"], "--seq-len 128 is not a multiple of --align 5"),
        ([*TINY, "--memory-budget-gib", "1e-6"], "--memory-budget-gib 1e-06: no Seq1F1B plan"),
        ([*TINY, "--cp", "0"], "argument --cp: expected a positive integer, got 0"),
        ([*TINY, "--cp", "3"],
         "--cp 3: context parallelism of degree 3 cuts every segment into 6 pieces, so segment "
         "lengths are multiples of 6 and seq_len 128 is not one; pick a seq_len divisible by 6 "
         "(e.g. 126 or 132)"),
        ([*TINY, "--cp", "2", "--align", "3", "--seq-len", "126"],
         "multiples of 12 (lcm with align 3)"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra,cp", [([], 1), (["--cp", "4"], 4)])
def test_the_context_parallel_degree_reaches_the_request(extra, cp):
    parser = cli._parser()
    args = parser.parse_args([*TINY, *extra, "--cp-bandwidth", "5e10", "--cp-latency", "1e-5"])
    request = cli._request(parser, args)
    assert (request.context_parallel, request.cp_bytes_per_second, request.cp_latency) == (
        cp, 5e10, 1e-5
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan --job-config NAME``: a torchtitan 0.3 (or main)
config function, read as its job lays it out."""

import json

import pytest
import torch

from torchtitan.models.llama3 import model_registry

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED, sequence_length
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import transformer_cost
from torchtitan_seq1f1b.tools.plan import cli

from tests.harness import REPO

# The shipped debug job: llama3 debugmodel, pp=2, 2 microbatches of 8 sequences of 64
# tokens (main: of one packed row of 256), Seq1F1B on 1F1B's layout, no TP or FSDP.
DEBUG_MODEL = transformer_cost(model_registry("debugmodel").model)
DEBUG_TOKENS, DEBUG_ROWS = (256, 1) if FOLDED else (64, 8)


def _request(*argv: str):
    parser = cli._parser()
    return cli._request(parser, parser.parse_args(["--job-config", "seq1f1b_debug", *argv]))


def test_the_job_config_gives_model_and_layout():
    request = _request()
    assert request.shape == DEBUG_MODEL
    assert (request.seq_len, request.num_ranks, request.stages_per_rank) == (DEBUG_TOKENS, 2, 1)
    assert (request.microbatches, request.microbatch_size) == (2, DEBUG_ROWS)
    assert request.dtype == torch.float32 and request.budget_bytes is None
    assert request.attention_backend == "auto" and request.align == 1


def test_options_override_the_job_config():
    """--schedule moves torch's layout along: the V's config splits the model in 2 stages per rank."""
    request = _request("--seq-len", "128", "-m", "4", "--schedule", "Seq1F1BZBV",
                       "--memory-budget-gib", "2", "--dtype", "bfloat16", "--align", "8")
    assert (request.seq_len, request.microbatches, request.microbatch_size) == (128, 4, 1)
    assert request.stages_per_rank == 2 and request.align == 8
    assert request.budget_bytes == 2 * 2**30 and request.dtype == torch.bfloat16


def test_the_context_parallel_degree_is_the_jobs_as_cp_overrides_it():
    """--cp sets the job's parallelism.context_parallel_degree, read back from the job
    config; every segment is cut into 2c pieces."""
    assert _request().context_parallel == 1
    request = _request("--cp", "2")
    assert request.context_parallel == 2 and request.align == 4


def test_plans_the_job_end_to_end_and_prints_its_flags(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert cli.main(["--job-config", "seq1f1b_debug", "--job-module", "torchtitan_seq1f1b",
                     "--threads", "1", "--max-segments", "4", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {r["num_segments"] for r in records} == {1, 2, 3, 4}
    assert all(sum(r["segment_lengths"]) == DEBUG_TOKENS for r in records)
    assert records[0]["calibrated_for"]["shape"]["dim"] == DEBUG_MODEL.dim
    chosen = next(r for r in records if r["chosen"])
    flags = capsys.readouterr().out.splitlines()[-1]
    expected = ("--module torchtitan_seq1f1b --config seq1f1b_debug "
                "--parallelism.pipeline_parallel_schedule 1F1B --seq1f1b.schedule Seq1F1B "
                f"--seq1f1b.num_segments {chosen['num_segments']} ")
    if chosen["partition"] == "time":
        expected += ("--seq1f1b.partition balanced --seq1f1b.segment_lengths "
                     + " ".join(map(str, chosen["segment_lengths"])))
    else:
        expected += f"--seq1f1b.partition {chosen['partition']}"
    assert flags == expected


def test_the_printed_flags_run_the_plan_the_command_made(capsys):
    """The layout options, the schedule's torch layout and a time-balanced cut come back as
    flags; built into the config, they give the job that plan, without the planner."""
    from torchtitan.config import ConfigManager

    from torchtitan_seq1f1b.integration.segment_plan import uses_planner

    assert cli.main(["--job-config", "seq1f1b_debug", "--seq-len", "96", "--schedule", "Seq1F1BZBV",
                     "--partitions", "time", "--threads", "1", "--max-segments", "3"]) == 0
    flags = capsys.readouterr().out.splitlines()[-1].split()
    assert flags[:4] == ["--module", "torchtitan_seq1f1b", "--config", "seq1f1b_debug"]
    config = ConfigManager().parse_args(flags)
    options = config.seq1f1b
    assert sequence_length(config.training) == 96 and options.schedule == "Seq1F1BZBV"
    assert config.parallelism.pipeline_parallel_schedule == "ZBVZeroBubble"
    assert sum(options.segment_lengths) == 96 and len(options.segment_lengths) == options.num_segments
    assert not uses_planner(options)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--job-config", str(REPO / "train_configs" / "debug_seq1f1b.toml")],
         "TOML job configs are torchtitan 0.2.2's, and torchtitan "
         f"{'main' if FOLDED else '0.3'} is installed"),
        (["--job-config", "nope"], "--config nope is neither a torchtitan_seq1f1b config"),
        (["--job-config", "seq1f1b_debug", "--job-module", "no_such_module"],
         "Cannot import module 'no_such_module'"),
        (["--job-config", "seq1f1b_debug", "--attention-backend", "flash"],
         "seq1f1b.attention_backend='flash' cannot run on cpu"),
        (["--job-config", "seq1f1b_debug", "--pp", "1"],
         "the job runs no Seq1F1B schedule (parallelism.pipeline_parallel_degree=1"),
        (["--job-config", "seq1f1b_debug", "--schedule", "Seq1F1BZBV", "-v", "1"],
         "Seq1F1BZBV runs between 2 and 2 stages"),
        (["--job-config", "llama3_debugmodel", "--job-module", "llama3"],
         "llama3 config 'llama3_debugmodel' is not a Seq1F1B job"),
        (["--job-module", "torchtitan_seq1f1b", "--model", "llama3-8b"],
         "--job-module names where --job-config's function is; give --job-config too"),
    ],
)
def test_a_job_config_the_job_would_refuse_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan --job-config``: a 0.2.2 TOML read as its job lays it out."""

import json

import pytest
import torch

from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_seq1f1b.integration import install
from torchtitan_seq1f1b.tools.plan import cli

from tests.harness import DEBUG_CONFIG

# The shipped debug job: llama3 debugmodel, seq_len 64, pp=2, 16 sequences in
# microbatches of 8, Seq1F1B, no TP or FSDP.
DEBUG_MODEL = get_train_spec("llama3").model_args["debugmodel"]


@pytest.fixture(autouse=True, scope="module")
def installed():
    install()


def _request(*argv: str):
    parser = cli._parser()
    return cli._request(parser, parser.parse_args(["--job-config", str(DEBUG_CONFIG), *argv]))


def test_the_job_config_gives_model_and_layout():
    request = _request()
    shape = request.shape
    assert (shape.n_layers, shape.dim, shape.n_heads, shape.vocab_size) == (
        DEBUG_MODEL.n_layers, DEBUG_MODEL.dim, DEBUG_MODEL.n_heads, DEBUG_MODEL.vocab_size
    )
    assert (request.seq_len, request.num_ranks, request.stages_per_rank) == (64, 2, 1)
    assert (request.microbatches, request.microbatch_size) == (2, 8)
    assert request.dtype == torch.float32 and request.budget_bytes is None
    assert request.attention_backend == "auto"


def test_options_override_the_job_config():
    request = _request("--seq-len", "128", "-m", "4", "--schedule", "InterleavedSeq1F1B",
                       "--memory-budget-gib", "2", "--dtype", "bfloat16")
    assert (request.seq_len, request.microbatches, request.microbatch_size) == (128, 4, 1)
    assert request.stages_per_rank == 2  # the interleaved schedule's split, as the job makes it
    assert request.budget_bytes == 2 * 2**30 and request.dtype == torch.bfloat16


def test_tensor_parallel_degree_is_folded_into_align(tmp_path):
    config = tmp_path / "tp.toml"
    config.write_text(
        DEBUG_CONFIG.read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    )
    parser = cli._parser()
    request = cli._request(parser, parser.parse_args(["--job-config", str(config), "--align", "8"]))
    assert request.align == 8
    request = cli._request(parser, parser.parse_args(["--job-config", str(config), "--align", "3", "--seq-len", "96"]))
    assert request.align == 6


def test_context_parallel_degree_is_read_and_folded_into_align(tmp_path):
    """TP = 2 x CP = 2 shards every segment into tp x 2c = 8 pieces; --cp overrides."""
    config = tmp_path / "tp_cp.toml"
    config.write_text(DEBUG_CONFIG.read_text().replace(
        "tensor_parallel_degree = 1", "tensor_parallel_degree = 2\ncontext_parallel_degree = 2"
    ))
    parser = cli._parser()
    request = cli._request(parser, parser.parse_args(["--job-config", str(config)]))
    assert request.context_parallel == 2 and request.align == 8
    request = cli._request(parser, parser.parse_args(["--job-config", str(config), "--cp", "1"]))
    assert request.context_parallel == 1 and request.align == 2


def test_plans_the_job_end_to_end(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert cli.main(["--job-config", str(DEBUG_CONFIG), "--threads", "1", "--max-segments", "4",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {r["num_segments"] for r in records} == {1, 2, 3, 4}
    assert all(sum(r["segment_lengths"]) == 64 for r in records)
    assert records[0]["calibrated_for"]["shape"]["dim"] == DEBUG_MODEL.dim
    assert 'pipeline_parallel_schedule = "Seq1F1B"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit,argv,message",
    [
        (None, ["--job-config", "missing.toml"], "job config 'missing.toml' is not a file"),
        (('"Seq1F1B"', '"1F1B"'), [], "pipeline_parallel_schedule='1F1B' is not a Seq1F1B schedule"),
        (('flavor = "debugmodel"', 'flavor = "tiny"'), [], "model.flavor='tiny' is not a llama3 flavor"),
        (None, ["--attention-backend", "flash"], "seq1f1b.attention_backend='flash' cannot run on cpu"),
        (None, ["--schedule", "Seq1F1BZBV", "-v", "1"], "Seq1F1BZBV runs between 2 and 2 stages"),
        (None, ["--job-module", "torchtitan_seq1f1b"], "--job-module names a torchtitan 0.3 config"),
    ],
)
def test_a_job_config_the_job_would_refuse_is_refused(edit, argv, message, tmp_path, capsys):
    config = DEBUG_CONFIG
    if edit is not None:
        config = tmp_path / "job.toml"
        config.write_text(DEBUG_CONFIG.read_text().replace(*edit))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--job-config", str(config), "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

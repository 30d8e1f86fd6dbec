# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The torchtitan 0.3 job config: flags, early errors naming the option, the debug command."""

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel_mtp
from torchtitan.tools import utils

from torchtitan_seq1f1b.integration.segment_plan import Seq1F1BConfigError
from torchtitan_seq1f1b.integration.titan_0_3.config_checks import check_config
from torchtitan_seq1f1b.integration.titan_0_3.config_registry import seq1f1b_debug
from torchtitan_seq1f1b.integration.titan_0_3.job_data import use_image_data, use_recall_data
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import segment_plan_for
from torchtitan_seq1f1b.integration.titan_0_3.torchtitan_configs import (
    import_registry,
    seq1f1b_config,
    seq1f1b_job,
    torchtitan_config_names,
)
from torchtitan_seq1f1b.integration.titan_0_3.trainer import Seq1F1BTrainer

from tests.harness import (
    REPO,
    RunFailed,
    TEST_ARGS,
    torchrun,
)


def parse(*args: str) -> Seq1F1BTrainer.Config:
    return ConfigManager().parse_args(
        ["--module", "torchtitan_seq1f1b", "--config", "seq1f1b_debug", *args]
    )


def problems_of(config: Seq1F1BTrainer.Config) -> str:
    with pytest.raises(Seq1F1BConfigError) as error:
        check_config(config)
    return str(error.value)


def test_every_option_is_a_flag():
    config = parse(
        "--seq1f1b.schedule", "Seq1F1BZBV",
        "--seq1f1b.num_segments", "2",
        "--seq1f1b.partition", "uniform",
        "--seq1f1b.attention_backend", "sdpa",
        "--seq1f1b.align", "4",
        "--seq1f1b.segment_lengths", "40", "24",
    )
    assert isinstance(config, Seq1F1BTrainer.Config)
    options = config.seq1f1b
    assert (options.schedule, options.num_segments, options.partition) == ("Seq1F1BZBV", 2, "uniform")
    assert (options.attention_backend, options.align, options.segment_lengths) == ("sdpa", 4, [40, 24])


def test_planner_options_are_flags_and_pass_the_checks():
    """num_segments "auto" and the planner's partitions; the plan is chosen on the device."""
    config = parse(
        "--seq1f1b.num_segments", "auto",
        "--seq1f1b.partition", "auto",
        "--seq1f1b.memory_budget_gib", "1.5",
    )
    options = config.seq1f1b
    assert (options.num_segments, options.partition, options.memory_budget_gib) == (
        "auto", "auto", 1.5
    )
    check_config(config)
    config = parse("--seq1f1b.partition", "time", "--seq1f1b.num_segments", "3")
    assert (config.seq1f1b.num_segments, config.seq1f1b.partition) == (3, "time")
    check_config(config)
    # A chunked loss with the planner: align keeps every planned length divisible.
    config = parse("--seq1f1b.num_segments", "auto", "--seq1f1b.align", "8")
    config.loss = ChunkedLossWrapper.Config(num_chunks=4)
    check_config(config)


def test_other_num_segments_strings_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--seq1f1b.num_segments", "many")
    assert "seq1f1b.num" in capsys.readouterr().err


def test_unknown_schedule_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse("--seq1f1b.schedule", "Seq1F1b")
    err = capsys.readouterr().err
    assert "seq1f1b.schedule" in err and "InterleavedSeq1F1B" in err


def test_the_debug_config_passes_and_pipeline_schedule_stays_a_torch_name():
    config = seq1f1b_debug()
    check_config(config)
    assert config.parallelism.pipeline_parallel_schedule == "1F1B"
    assert config.training.disable_cuda_graphs


def debug_job_of_64_tokens() -> Seq1F1BTrainer.Config:
    """``seq1f1b_debug`` cutting 64-token sequences: 0.3's rows, or main's packed row."""
    config = seq1f1b_debug()
    if FOLDED:
        config.training.num_tokens_per_microbatch_per_dp_rank = 64
    return config


def test_every_problem_is_named_at_once():
    config = debug_job_of_64_tokens()
    config.seq1f1b.num_segments = 300
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    config.parallelism.pipeline_parallel_schedule_csv = "order.csv"
    config.compile.enable = True
    config.seq1f1b.schedule = "Seq1F1BZBV"
    message = problems_of(config)
    assert "300 segments of at least 1 tokens do not fit in 64" in message
    assert "seq1f1b.num_segments=300" in message
    assert (
        "seq1f1b.schedule='Seq1F1BZBV' runs on the stage layout of 'ZBVZeroBubble', but "
        "parallelism.pipeline_parallel_schedule='Interleaved1F1B'"
    ) in message
    assert "parallelism.pipeline_parallel_schedule_csv is set" in message
    assert "compile.enable cannot run under Seq1F1BZBV" in message


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: setattr(c.seq1f1b, "num_segments", 0),
         "seq1f1b.num_segments=0 must be an integer >= 1 or 'auto'"),
        (lambda c: setattr(c.seq1f1b, "num_segments", "many"),
         "seq1f1b.num_segments='many' must be an integer >= 1 or 'auto'"),
        (lambda c: (setattr(c.seq1f1b, "num_segments", "auto"),
                    setattr(c.seq1f1b, "segment_lengths", [32, 32])),
         "seq1f1b.segment_lengths=[32, 32] fixes the plan, but num_segments='auto' / "
         "partition='balanced' ask the planner for one"),
        (lambda c: (setattr(c.seq1f1b, "partition", "auto"),
                    setattr(c.seq1f1b, "segment_lengths", [32, 32])),
         "seq1f1b.segment_lengths=[32, 32] fixes the plan, but num_segments=4 / "
         "partition='auto' ask the planner for one"),
        (lambda c: (setattr(c.seq1f1b, "num_segments", "auto"),
                    setattr(c.seq1f1b, "memory_budget_gib", 0.0)),
         "seq1f1b.memory_budget_gib=0.0 must be > 0 (or unset)"),
        (lambda c: setattr(c.seq1f1b, "memory_budget_gib", -1.0),
         "seq1f1b.memory_budget_gib=-1.0 must be > 0 (or unset)"),
        (lambda c: setattr(c.seq1f1b, "segment_lengths", [32, 16]),
         "seq1f1b.segment_lengths=[32, 16] sum to 48, not 64"),
        (lambda c: (setattr(c.parallelism, "context_parallel_degree", 2),
                    setattr(c.seq1f1b, "segment_lengths", [30, 34])),
         "lengths=[30, 34] has [30, 34] not a multiple of align=4; use multiples of 4, "
         "e.g. [32, 32]"),
        (lambda c: (setattr(c.parallelism, "context_parallel_degree", 2),
                    setattr(c.parallelism, "context_parallel_load_balancer", "ptrr")),
         "parallelism.context_parallel_load_balancer='ptrr' with context_parallel_degree=2: "
         "Seq1F1B balances CP itself, head-tail inside every segment"),
        (lambda c: (setattr(c.parallelism, "context_parallel_degree", 2),
                    setattr(c.parallelism, "spmd_backend", "partial_dtensor")),
         "parallelism.spmd_backend='partial_dtensor' with context_parallel_degree=2"),
        (lambda c: (setattr(c.parallelism, "context_parallel_degree", 2),
                    setattr(c.validator, "enable", True)),
         "validator.enable with context_parallel_degree=2"),
        (lambda c: (setattr(c.seq1f1b, "schedule", "Seq1F1BZeroBubble"),
                    setattr(c, "activation_checkpoint", SelectiveAC.Config())),
         "activation_checkpoint:selective cannot run under seq1f1b.schedule='Seq1F1BZeroBubble'"),
        (lambda c: setattr(c, "loss", ChunkedLossWrapper.Config(num_chunks=5)),
         "loss.num_chunks=5 must divide every segment length [16, 16, 16, 16]"),
        (lambda c: (setattr(c.parallelism, "context_parallel_degree", 2),
                    setattr(c.seq1f1b, "partition", "uniform"),
                    setattr(c, "loss", ChunkedLossWrapper.Config(num_chunks=16))),
         "loss.num_chunks=16 must divide every segment length / context_parallel_degree=2 "
         "[8, 8, 8, 8]"),
        (lambda c: (setattr(c.seq1f1b, "num_segments", "auto"),
                    setattr(c, "loss", ChunkedLossWrapper.Config(num_chunks=4))),
         "loss.num_chunks=4 must divide every segment length (the chunked loss cuts each "
         "segment's output), but seq1f1b.num_segments='auto' / partition='balanced' let the "
         "planner choose lengths that are only multiples of 1"),
    ],
    ids=[
        "num_segments", "num_segments_string", "auto_with_lengths", "auto_partition_with_lengths",
        "zero_budget", "negative_budget", "segment_lengths", "cp_segment_lengths",
        "cp_load_balancer", "cp_spmd_backend", "cp_validator", "selective_ac",
        "chunked_loss", "cp_chunked_loss", "planned_chunked_loss",
    ],
)
def test_bad_option_is_named(change, message):
    config = debug_job_of_64_tokens()
    config.seq1f1b.segment_lengths = []
    change(config)
    assert message in problems_of(config)


def test_other_models_are_refused_with_the_reason():
    config = seq1f1b_debug()
    config.model_spec = dataclasses.replace(config.model_spec, name="mistral")
    problems = problems_of(config)
    assert "model 'mistral': it is not verified under Seq1F1B" in problems
    assert (
        "Seq1F1B supports ['llama3', 'qwen3', 'qwen3_5', 'deepseek_v3', 'gpt_oss', 'kimi_k2_5']"
        in problems
    )


def qwen3_5_job(data: str = "recall") -> Seq1F1BTrainer.Config:
    """``--config qwen35_debugmodel`` at PP = 2 as the trainer checks it, with
    ``--seq1f1b.data recall`` or ``images``."""
    config = ConfigManager().parse_args([
        "--module", "torchtitan_seq1f1b", "--config", "qwen35_debugmodel",
        "--parallelism.pipeline_parallel_degree", "2",
    ])
    (use_recall_data if data == "recall" else use_image_data)(config)
    return config


@pytest.mark.parametrize("data", ["recall", "images"])
def test_qwen3_5_trains_on_the_shipped_corpora(data):
    config = qwen3_5_job(data)
    assert config.model_spec.name == "qwen3_5" and config.seq1f1b.schedule == "Seq1F1B"
    check_config(config)


def _vision(config):
    """The image corpus' vision settings of a job that trains on it."""
    loader = config.dataloader
    return loader.dataset.vision if FOLDED else loader.vision


def test_the_image_corpus_takes_the_models_vision_settings():
    qwen = _vision(qwen3_5_job("images"))
    assert (qwen.patch_size, qwen.temporal_patch_size, qwen.patch_order) == (16, 2, "block")
    assert qwen.build_mrope_positions and not qwen.shared_placeholder


def test_the_image_corpus_takes_kimis_vision_settings():
    kimi = import_registry("kimi_k2_7", "kimi_k2_5_debugmodel").kimi_k2_5_debugmodel()
    use_image_data(kimi)
    loader = _vision(kimi)
    assert (loader.patch_size, loader.temporal_patch_size, loader.patch_order) == (14, 1, "raster")
    assert not loader.build_mrope_positions and loader.shared_placeholder


@pytest.mark.titan_0_3_only("kimi_k2_5's configs are checked on 0.3")
def test_kimi_configs_name_torchtitans_own_refusal():
    """torchtitan's kimi configs refuse their DistMuon under pipeline parallelism."""
    with pytest.raises(ValueError, match="torchtitan itself refuses it under pipeline "
                       "parallelism: Kimi DistMuon currently requires"):
        ConfigManager().parse_args([
            "--module", "torchtitan_seq1f1b", "--config", "kimi_k2_5_debugmodel",
        ])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: setattr(c.parallelism, "context_parallel_degree", 2),
         "parallelism.context_parallel_degree=2 with GatedDeltaNet layers [0, 1, 2, 4, 5, 6]: "
         "their recurrence runs each segment on one rank"),
        (lambda c: setattr(c.parallelism, "tensor_parallel_degree", 2),
         "parallelism.tensor_parallel_degree=2 with GatedDeltaNet layers [0, 1, 2, 4, 5, 6]: "
         "the segment-aware GatedDeltaNet is not sharded by heads; set "
         "--parallelism.tensor_parallel_degree 1"),
    ],
    ids=["context_parallel", "tensor_parallel"],
)
def test_qwen3_5_refusals_name_the_option(change, message):
    config = qwen3_5_job()
    change(config)
    assert message in problems_of(config)


@pytest.mark.parametrize("data", ["config", "images"])
def test_images_under_context_parallelism_are_refused(data):
    config = qwen3_5_job("images")
    if data == "config":  # torchtitan's own multimodal dataloader
        config.dataloader = ConfigManager().parse_args([
            "--module", "torchtitan_seq1f1b", "--config", "qwen35_debugmodel",
        ]).dataloader
    config.parallelism.context_parallel_degree = 2
    assert (
        "parallelism.context_parallel_degree=2 with images for 'qwen3_5': the image "
        "features are scattered into whole segments on one rank"
    ) in problems_of(config)


def test_qwen3_5_refusals_fail_on_every_rank_before_training(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(
            tmp_path, 2, "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.context_parallel_degree", "2",
            config="torchtitan_seq1f1b:qwen35_debugmodel", timeout=120,
        )
    output = failure.value.output
    assert output.count("Seq1F1BConfigError: Seq1F1B cannot run this job") >= 2
    for message in ("context_parallel_degree=2 with images", "context_parallel_degree=2 with GatedDeltaNet"):
        assert output.count(message) >= 2
    assert "Training starts" not in output


def test_a_registry_that_does_not_import_names_what_to_install(monkeypatch):
    """qwen3_5's registry needs fla; its configs are still found, by their source."""
    assert "qwen35_debugmodel" in torchtitan_config_names()
    real_import = importlib.import_module

    def without_fla(name, *args):
        if name.startswith("torchtitan.models.qwen3_5"):
            raise ModuleNotFoundError("No module named 'fla'", name="fla")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_fla)
    with pytest.raises(ValueError) as error:
        seq1f1b_config("qwen35_debugmodel", [])
    assert str(error.value) == (
        "--config qwen35_debugmodel is in torchtitan's qwen3_5 registry, which cannot be "
        "imported here: No module named 'fla'; pip install 'torchtitan-seq1f1b[qwen35]'"
    )


def test_options_do_not_matter_without_seq1f1b():
    config = seq1f1b_debug()
    config.seq1f1b.num_segments = 300
    config.parallelism.pipeline_parallel_degree = 1
    check_config(config)
    config.parallelism.pipeline_parallel_degree = 2
    config.seq1f1b.schedule = "none"
    check_config(config)


def test_context_parallel_plans_align_to_its_pieces(monkeypatch):
    """num_segments plans give lengths CP = 2 can cut into 4 head-tail pieces; on CPU a
    job without a Seq1F1B schedule is refused CP, which only those schedules cut."""
    config = seq1f1b_debug()
    config.parallelism.context_parallel_degree = 2
    config.seq1f1b.num_segments = 3
    check_config(config)
    plan = segment_plan_for(config.seq1f1b, 64, 2, config.model_spec.model, cp=2)
    assert sum(plan.lengths) == 64 and all(n % 8 == 0 for n in plan.lengths)
    config.seq1f1b.schedule = "none"
    monkeypatch.setattr(utils, "device_type", "cpu")  # what the CPU shim sets
    assert "without a Seq1F1B schedule: on CPU only Seq1F1B's" in problems_of(config)
    monkeypatch.setattr(utils, "device_type", "cuda")  # torchtitan's own CP
    check_config(config)


def test_the_128k_context_parallel_config_passes_its_checks(tmp_path):
    """As ``--config`` names it; its tokenizer is where a GPU node keeps it."""
    config = ConfigManager().parse_args([
        "--module", "torchtitan_seq1f1b", "--config", "seq1f1b_llama3_8b_128k",
        "--hf_assets_path", str(tmp_path),
    ])
    check_config(config)
    parallelism = config.parallelism
    assert (parallelism.pipeline_parallel_degree, parallelism.context_parallel_degree) == (4, 2)
    plan = segment_plan_for(config.seq1f1b, 131072, 1, config.model_spec.model, cp=2)
    assert plan.num_segments == 8 and all(n % 128 == 0 for n in plan.lengths)


def test_torch_schedules_with_checkpointing_are_refused_on_cpu(monkeypatch):
    """Their CPU attention would recompute a microbatch with a later one's documents."""
    config = seq1f1b_debug()
    config.seq1f1b.schedule = "none"
    config.activation_checkpoint = SelectiveAC.Config()
    monkeypatch.setattr(utils, "device_type", "cpu")  # what the CPU shim sets
    assert "cannot recompute activation-checkpointed microbatches" in problems_of(config)
    config.parallelism.pipeline_parallel_degree = 1
    check_config(config)
    config.parallelism.pipeline_parallel_degree = 2
    monkeypatch.setattr(utils, "device_type", "cuda")  # torchtitan's own attention
    check_config(config)


@pytest.mark.parametrize(
    "args,message",
    [
        (("--seq1f1b.num_segments", "0"),
         "seq1f1b.num_segments=0 must be an integer >= 1 or 'auto'"),
        # A kernel that cannot run on this device is found at start-up, not
        # inside the first step on one rank.
        (("--seq1f1b.attention_backend", "varlen"),
         "seq1f1b.attention_backend='varlen' cannot run on cpu"),
    ],
)
def test_bad_config_fails_on_every_rank_before_training(tmp_path, args, message):
    with pytest.raises(RunFailed) as failure:
        torchrun(tmp_path, 2, *TEST_ARGS, *args, timeout=120)
    output = failure.value.output
    # Both ranks raise (before the process group exists, without a rank prefix).
    assert output.count("Seq1F1BConfigError: Seq1F1B cannot run this job") >= 2
    assert output.count(message) >= 2
    assert "Training starts" not in output
    assert "Connection closed by peer" not in output


def test_the_documented_debug_command_trains(tmp_path):
    """README's command from any directory, a few steps: Seq1F1B PP=2, k=4."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "-m", "torchtitan.train", "--module", "torchtitan_seq1f1b", "--config", "seq1f1b_debug",
        "--training.steps", "5", "--metrics.log_freq", "1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Using pipeline schedule Seq1F1B on the stage layout of 1F1B" in output
    assert "step:  5" in output
    assert "Seq1F1B: trained steps 1-5; loss " in output
    corpus = (
        "(doc_tokens=129,seed=0,words=64), segments [67, 65, 63, 61]: no model that cannot "
        "attend to earlier segments gets below loss 3.2076" if FOLDED else
        "(doc_tokens=65,seed=0,words=64), segments [16, 16, 16, 16]: no model that cannot "
        "attend to earlier segments gets below loss 3.9009"
    )
    assert f"recall corpus {corpus}" in output
    assert (tmp_path / "outputs" / "seq1f1b_debug" / "checkpoint" / "step-5").is_dir()


def test_multi_token_prediction_is_refused_naming_the_config_without_it():
    config = seq1f1b_job(deepseek_v3_debugmodel_mtp(), "deepseek_v3_debugmodel_mtp")
    config.parallelism.pipeline_parallel_degree = 2
    assert "predicts 1 extra token(s) (multi-token prediction)" in problems_of(config)

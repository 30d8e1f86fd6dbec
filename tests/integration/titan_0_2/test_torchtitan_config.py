# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Start-up rejections of the torchtitan integration, checked in-process.

``pipeline_llm_seq1f1b`` validates the job before it touches a device mesh,
so a bad config raises the same message on every rank before any collective
(tests/integration/test_torchtitan.py shows that end to end under torchrun).
"""

import pytest
import torch

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_seq1f1b.integration import install
from torchtitan_seq1f1b.integration.titan_0_2 import pipeline_llm_seq1f1b
from torchtitan_seq1f1b.integration.titan_0_2.config_checks import Seq1F1BUsageError
from torchtitan_seq1f1b.integration.titan_0_2.pipeline import (
    check_job,
    module_names_per_stage,
    Seq1F1BConfigError,
    segment_plan_for,
)
from torchtitan_seq1f1b.integration.schedules import SCHEDULES

from tests.harness import DEBUG_CONFIG, REPO


@pytest.fixture(autouse=True, scope="module")
def installed():
    """What ``custom_import`` does in a job (this process may have imported the
    package before torchtitan, when importing it installs nothing)."""
    install()


def _job(config, *args):
    job_config = ConfigManager().parse_args(["--job.config_file", str(config), *args])
    spec = get_train_spec(job_config.model.name)
    model_args = spec.model_args[job_config.model.flavor]
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return job_config, spec, model_args, model


def start(*args: str, tp: int = 1, cp: int = 1, pp: int = 2):
    job_config, spec, model_args, model = _job(DEBUG_CONFIG, *args)
    dims = ParallelDims(
        dp_shard=1, dp_replicate=1, cp=cp, tp=tp, pp=pp, ep=1, etp=1,
        world_size=tp * cp * pp,
    )
    return spec.pipelining_fn(
        model, dims, job_config, torch.device("cpu"), model_args, spec.parallelize_fn, None
    )


@pytest.mark.parametrize(
    "name,segments",
    [("llama3_8b_32k_seq1f1b", 4), ("llama3_8b_64k_seq1f1b", 8), ("llama3_70b_128k_seq1f1b", 8)],
)
def test_real_hardware_configs_pass_start_up_checks(name, segments, monkeypatch):
    """On the H100s (sm90, flash-attn installed) the configs are written for."""
    from torchtitan_seq1f1b.attention import FlashAttnBackend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(FlashAttnBackend, "installed", classmethod(lambda cls: True))
    job_config, _, model_args, model = _job(REPO / "train_configs" / f"{name}.toml")
    parallelism = job_config.parallelism
    dims = ParallelDims(
        dp_shard=parallelism.data_parallel_shard_degree, dp_replicate=1, cp=1,
        tp=parallelism.tensor_parallel_degree, pp=parallelism.pipeline_parallel_degree,
        ep=1, etp=1,
        world_size=parallelism.data_parallel_shard_degree
        * parallelism.tensor_parallel_degree
        * parallelism.pipeline_parallel_degree,
    )
    check_job(job_config, dims, model_args, torch.device("cuda", 0))
    entry = SCHEDULES[parallelism.pipeline_parallel_schedule]
    assert len(module_names_per_stage(job_config, dims, model_args, entry)) == dims.pp
    plan = segment_plan_for(job_config, model, dims)
    assert plan.num_segments == segments and plan.seq_len == job_config.training.seq_len
    assert all(length % 128 == 0 for length in plan.lengths)
    assert list(plan.lengths) == sorted(plan.lengths, reverse=True)


def test_seq1f1b_is_the_llama3_pipelining_function():
    assert get_train_spec("llama3").pipelining_fn is pipeline_llm_seq1f1b


@pytest.mark.parametrize(
    "name,stages_per_rank",
    [("InterleavedSeq1F1B", 2), ("Seq1F1BZeroBubble", 1), ("Seq1F1BZBV", 2)],
)
def test_variant_stage_layouts_follow_torchtitan_rules(name, stages_per_rank):
    job_config, _, model_args, _ = _job(
        DEBUG_CONFIG, "--parallelism.pipeline_parallel_schedule", name
    )
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    names = module_names_per_stage(job_config, dims, model_args, SCHEDULES[name])
    assert len(names) == 2 * stages_per_rank
    assert names[0][0] == "tok_embeddings" and names[-1][-1] == "output"


def test_seq1f1b_section_is_on_the_command_line():
    job_config = ConfigManager().parse_args(
        ["--job.config_file", str(DEBUG_CONFIG), "--seq1f1b.num_segments", "3",
         "--seq1f1b.partition", "uniform", "--seq1f1b.attention_backend", "sdpa",
         "--seq1f1b.align", "8", "--seq1f1b.segment_lengths", "128", "128"]
    )
    options = job_config.seq1f1b
    assert (options.num_segments, options.partition, options.attention_backend) == (
        3, "uniform", "sdpa"
    )
    assert (options.align, options.segment_lengths) == (8, [128, 128])


def test_auto_num_segments_parses_from_the_command_line_and_toml(tmp_path):
    job_config = ConfigManager().parse_args(
        ["--job.config_file", str(DEBUG_CONFIG), "--seq1f1b.num_segments", "auto",
         "--seq1f1b.partition", "auto", "--seq1f1b.memory_budget_gib", "1.5"]
    )
    options = job_config.seq1f1b
    assert (options.num_segments, options.partition, options.memory_budget_gib) == (
        "auto", "auto", 1.5
    )
    config = tmp_path / "auto.toml"
    config.write_text(
        DEBUG_CONFIG.read_text()
        .replace("num_segments = 4", 'num_segments = "auto"\nmemory_budget_gib = 0.25')
        .replace('partition = "balanced"', 'partition = "time"')
    )
    options = ConfigManager().parse_args(["--job.config_file", str(config)]).seq1f1b
    assert (options.num_segments, options.partition, options.memory_budget_gib) == (
        "auto", "time", 0.25
    )
    # The planner's options pass the start-up checks; the plan is chosen on the device.
    job_config, _, model_args, _ = _job(config)
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    check_job(job_config, dims, model_args, torch.device("cpu"))


def test_other_num_segments_strings_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(
            ["--job.config_file", str(DEBUG_CONFIG), "--seq1f1b.num_segments", "many"]
        )
    assert "--seq1f1b.num-segments" in capsys.readouterr().err
    # TOML values are not type-checked while parsing; the start-up checks name them.
    config = tmp_path / "many.toml"
    config.write_text(
        DEBUG_CONFIG.read_text()
        .replace("num_segments = 4", 'num_segments = "many"')
        .replace('partition = "balanced"', 'partition = "fastest"')
    )
    job_config, _, model_args, _ = _job(config)
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    with pytest.raises(Seq1F1BConfigError) as error:
        check_job(job_config, dims, model_args, torch.device("cpu"))
    assert "seq1f1b.num_segments='many' must be an integer >= 1 or 'auto'" in str(error.value)
    assert (
        "seq1f1b.partition='fastest' must be one of ('uniform', 'balanced', 'time', 'auto')"
    ) in str(error.value)


def _usage_error(tmp_path, toml_text: str, *args: str) -> str:
    config = tmp_path / "job.toml"
    config.write_text(
        '[job]\ncustom_config_module = "torchtitan_seq1f1b.job_config"\n' + toml_text
    )
    with pytest.raises(Seq1F1BUsageError) as error:
        ConfigManager().parse_args(["--job.config_file", str(config), *args])
    assert str(error.value.code) == f"torchtitan_seq1f1b: error: {error.value.message}"
    return error.value.message


def test_misspelt_seq1f1b_key_names_the_valid_keys(tmp_path):
    message = _usage_error(tmp_path, "[seq1f1b]\nnum_segment = 4\n")
    assert message == (
        "[seq1f1b] num_segment is not an option; did you mean 'num_segments'? "
        "[seq1f1b] takes: num_segments, partition, memory_budget_gib, attention_backend, align, "
        "segment_lengths"
    )
    message = _usage_error(tmp_path, "[seq1f1b]\nnum_segments = 4\nflavour = 1\n")
    assert message.startswith("[seq1f1b] flavour is not an option; [seq1f1b] takes:")
    message = _usage_error(tmp_path, "[seq1f1]\nnum_segments = 4\n")
    assert message == "[seq1f1] is not a section; did you mean [seq1f1b]?"


@pytest.mark.parametrize(
    "name,closest",
    [("Seq1F1b", "Seq1F1B"), ("seq1f1b_zbv", "Seq1F1BZBV"), ("InterleavedSeq1F1", "InterleavedSeq1F1B"),
     ("1F1b_", "1F1B"), ("banana", None)],
)
def test_misspelt_schedule_names_ours_and_torchs(tmp_path, name, closest):
    message = _usage_error(
        tmp_path,
        f'[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "{name}"\n',
    )
    hint = f"did you mean {closest!r}? " if closest else ""
    assert message.startswith(
        f"parallelism.pipeline_parallel_schedule = {name!r} is not a schedule; {hint}"
        "Seq1F1B schedules (exact case): Seq1F1B, InterleavedSeq1F1B, Seq1F1BZeroBubble, "
        "Seq1F1BZBV; torch's: 1F1B, GPipe, Interleaved1F1B,"
    ), message


def test_schedule_names_torch_accepts_still_parse():
    for name in ("Seq1F1BZBV", "interleaved1f1b", "ZBVZeroBubble"):
        job_config = ConfigManager().parse_args(
            ["--job.config_file", str(DEBUG_CONFIG),
             "--parallelism.pipeline_parallel_schedule", name]
        )
        assert job_config.parallelism.pipeline_parallel_schedule == name
    # Without pipelining the name is never read, so it is not checked.
    ConfigManager().parse_args(
        ["--job.config_file", str(DEBUG_CONFIG), "--parallelism.pipeline_parallel_degree", "1",
         "--parallelism.pipeline_parallel_schedule", "Seq1F1b"]
    )


def test_usage_error_prints_on_local_rank_0_only(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Seq1F1BUsageError("x").code == 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Seq1F1BUsageError("x").code == "torchtitan_seq1f1b: error: x"


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        (("--parallelism.context_parallel_degree", "2",
          "--parallelism.context_parallel_load_balancer", "ptrr"), {"cp": 2},
         "parallelism.context_parallel_load_balancer='ptrr' with context_parallel_degree=2: "
         "Seq1F1B balances CP itself"),
        (("--validation.enable",), {"cp": 2},
         "validation.enable with context_parallel_degree=2"),
        (("--seq1f1b.segment_lengths", "30", "34"), {"cp": 2},
         "not a multiple of align=4; use multiples of 4, e.g. [32, 32]"),
        (("--compile.enable", "--parallelism.pipeline_parallel_schedule", "Seq1F1BZeroBubble"),
         {}, "compile.enable cannot run under Seq1F1BZeroBubble"),
        (("--compile.enable", "--compile.components", "loss",
          "--parallelism.pipeline_parallel_schedule", "Seq1F1BZBV"),
         {}, "compile.enable cannot run under Seq1F1BZBV"),
        (("--parallelism.pipeline_parallel_microbatch_size", "3"), {},
         "training.local_batch_size=16 must be a multiple of "
         "parallelism.pipeline_parallel_microbatch_size=3"),
        (("--seq1f1b.num_segments", "0"), {},
         "seq1f1b.num_segments=0 must be an integer >= 1 or 'auto'"),
        (("--seq1f1b.num_segments", "300"), {}, "300 segments of at least 1 tokens do not fit in 64"),
        (("--seq1f1b.num_segments", "auto", "--seq1f1b.segment_lengths", "32", "32"), {},
         "seq1f1b.segment_lengths=[32, 32] fixes the plan, but num_segments='auto' / "
         "partition='balanced' ask the planner for one"),
        (("--seq1f1b.partition", "time", "--seq1f1b.segment_lengths", "32", "32"), {},
         "seq1f1b.segment_lengths=[32, 32] fixes the plan, but num_segments=4 / "
         "partition='time' ask the planner for one"),
        (("--seq1f1b.num_segments", "auto", "--seq1f1b.memory_budget_gib", "0"), {},
         "seq1f1b.memory_budget_gib=0.0 must be > 0 (or unset)"),
        (("--seq1f1b.memory_budget_gib", "-2.5"), {},
         "seq1f1b.memory_budget_gib=-2.5 must be > 0 (or unset)"),
        (("--seq1f1b.num_segments", "130"), {"tp": 2}, "130 segments of at least 2 tokens"),
        (("--training.seq_len", "250", "--seq1f1b.align", "8"), {}, "align=8"),
        (("--training.seq_len", "254"), {"tp": 4}, "x tp=4"),
        (("--seq1f1b.segment_lengths", "100", "100"), {}, "segment_lengths"),
        (("--validation.enable", "--validation.seq_len", "512"), {},
         "validation.seq_len=512 differs from training.seq_len=64"),
        (("--parallelism.pipeline_parallel_layers_per_stage", "1"), {},
         "pipeline_parallel_layers_per_stage=1 gives 8 stages"),
        (("--parallelism.pipeline_parallel_schedule_csv", "x.csv"), {},
         "pipeline_parallel_schedule_csv"),
        (("--parallelism.pipeline_parallel_schedule", "Seq1F1BZeroBubble",
          "--parallelism.pipeline_parallel_layers_per_stage", "2"), {},
         "gives 4 stages, but Seq1F1BZeroBubble needs one stage per pipeline rank (2 stages)"),
        (("--parallelism.pipeline_parallel_schedule", "InterleavedSeq1F1B",
          "--parallelism.pipeline_parallel_layers_per_stage", "4"), {},
         "gives 2 stages, but InterleavedSeq1F1B needs a multiple of the pipeline "
         "degree (2) with at least 2 stages per rank"),
        (("--parallelism.pipeline_parallel_schedule", "InterleavedSeq1F1B",
          "--parallelism.pipeline_parallel_layers_per_stage", "3"), {},
         "gives 3 stages, but InterleavedSeq1F1B needs a multiple"),
        (("--parallelism.pipeline_parallel_schedule", "Seq1F1BZBV",
          "--parallelism.pipeline_parallel_layers_per_stage", "1"), {},
         "gives 8 stages, but Seq1F1BZBV needs exactly 2 stages per pipeline rank (4 stages)"),
        (("--seq1f1b.attention_backend", "varlen"), {},
         "seq1f1b.attention_backend='varlen' cannot run on cpu, float32, head_dim 16: it "
         "needs a CUDA device (this runs on cpu)"),
        (("--seq1f1b.attention_backend", "flash"), {},
         "seq1f1b.attention_backend='flash' cannot run on cpu"),
        (("--parallelism.pipeline_parallel_schedule", "Seq1F1BZeroBubble",
          "--activation_checkpoint.mode", "selective",
          "--activation_checkpoint.selective_ac_option", "op"), {},
         "selective_ac_option='op' cannot run under Seq1F1BZeroBubble"),
    ],
)
def test_unsupported_jobs_are_rejected_with_the_option_named(args, kwargs, message):
    with pytest.raises(Seq1F1BConfigError, match=None) as error:
        start(*args, **kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("flavor", ["debugmodel_flex_attn", "debugmodel_varlen_attn"])
def test_block_causal_flavors_pass_start_up_checks(flavor):
    job_config, _, model_args, _ = _job(DEBUG_CONFIG, "--model.flavor", flavor)
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    assert model_args.attn_mask_type == "block_causal"
    check_job(job_config, dims, model_args, torch.device("cpu"))


@pytest.mark.parametrize(
    "attn_type,mask_type,message",
    [
        ("varlen", "causal", "attn_type='varlen' with attn_mask_type='causal', which "
         "torchtitan itself rejects"),
        ("flex", "sliding_window", "attn_mask_type='sliding_window': Seq1F1B reproduces "
         "'causal' and 'block_causal'"),
    ],
)
def test_attention_seq1f1b_cannot_reproduce_is_rejected(monkeypatch, attn_type, mask_type, message):
    args = get_train_spec("llama3").model_args["debugmodel_flex_attn"]
    monkeypatch.setattr(args, "attn_type", attn_type)
    monkeypatch.setattr(args, "attn_mask_type", mask_type)
    with pytest.raises(Seq1F1BConfigError) as error:
        start("--model.flavor", "debugmodel_flex_attn")
    assert f"model.flavor='debugmodel_flex_attn': {message}" in str(error.value)
    assert "use a flavor with attn_type='sdpa', or 'flex'/'varlen' with " in str(error.value)


def test_cpu_support_changes_nothing_where_an_accelerator_exists(monkeypatch):
    from torchtitan_seq1f1b.integration import cpu
    from torchtitan_seq1f1b.integration.titan_0_2 import DEVICE_CONSUMERS

    monkeypatch.setattr(cpu, "available_device_type", lambda: "cuda")
    assert cpu.enable_cpu_training(DEVICE_CONSUMERS) is False


def test_cpu_support_points_torchtitan_at_the_cpu():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp import FSDPModule

    assert metrics.device_type == dist_utils.device_type == "cpu"
    assert dist_utils.device_module.current_device() == 0
    assert dist_utils.device_module.memory_stats()["active_bytes.all.peak"] > 0
    assert getattr(FSDPModule.set_gradient_divide_factor, "_seq1f1b_cpu", False)


def test_run_summary_lines():
    from types import SimpleNamespace

    from torchtitan_seq1f1b.integration.titan_0_2.summary import run_summary

    job_config, *_ = _job(DEBUG_CONFIG)
    schedule = SimpleNamespace(segment_plan=SimpleNamespace(lengths=(16, 16, 16, 16)))
    below, above = (
        run_summary(job_config, schedule, 1, 300, [loss]) for loss in (3.0, 4.0)
    )
    assert below[0] == "Seq1F1B: trained steps 1-300; loss 3.0000 (mean of the last 1 logged steps)"
    assert "no model that cannot attend to earlier segments gets below loss 3.9009" in below[1]
    assert below[2] == "achieved loss 3.0000 is 0.9009 below it: the model attends across segments"
    assert above[2] == "achieved loss 4.0000 is not below it yet: train longer"
    assert run_summary(job_config, schedule, 301, 302, []) == [
        "Seq1F1B: trained steps 301-302; no loss was logged"
    ]
    assert run_summary(job_config, None, None, 300, [])[0].startswith(
        "Seq1F1B: no step trained: the run resumed at step 300 from "
        "./outputs/debug_seq1f1b/checkpoint and training.steps = 300; raise --training.steps"
    )
    job_config.training.seq_len = 128
    assert "no bound for doc_tokens=65 at seq_len=128" in run_summary(
        job_config, schedule, 1, 2, [4.0]
    )[1]


def test_block_causal_debug_job_starts_and_reports_its_bound():
    from types import SimpleNamespace

    from torchtitan_seq1f1b.integration.titan_0_2.summary import run_summary

    job_config, _, model_args, _ = _job(REPO / "train_configs" / "debug_seq1f1b_block_causal.toml")
    assert (model_args.attn_type, model_args.attn_mask_type) == ("flex", "block_causal")
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    check_job(job_config, dims, model_args, torch.device("cpu"))
    schedule = SimpleNamespace(segment_plan=SimpleNamespace(lengths=(33, 32, 32, 31)))
    lines = run_summary(job_config, schedule, 1, 300, [2.78])
    assert lines[1] == (
        "recall corpus (doc_tokens=43,seed=0,words=64), segments [33, 32, 32, 31]: no model "
        "that cannot attend to earlier segments gets below loss 3.0360; the lowest any model "
        "can reach is 1.8715"
    )

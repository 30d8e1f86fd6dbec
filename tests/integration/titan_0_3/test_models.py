# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's own model configs as Seq1F1B jobs (``--config <registry function>``).

Each model starts from its own seed checkpoint and trains on the shipped
recall corpus (``--seq1f1b.data recall``: torchtitan's debug configs read its
repository's test assets) with packed documents, under the config's own loss
and activation checkpointing (qwen3_moe_debug with 16 of its 64 experts:
:mod:`tests.integration.titan_0_3.fewer_experts`). Seq1F1B PP=2 (and a
variant, ``VARIANTS``, but for qwen3_moe) must match the
non-pipelined run on every step's loss (``MODELS``) and the step-1 grad_norm within 1e-4,
and end with the same MoE load-balancing state: the expert biases the router
learns from its token counts, saved at the last step, must be equal and must have
moved. Routed experts run in the model's dtype
(:mod:`tests.integration.titan_0_3.input_dtype_experts`).

llama3's debug config runs as the README documents it
(``tests/test_documented_commands.py``) and as the debug job
(``test_torchtitan.py``); qwen3's dense layers are checked in float64 layer by
layer (``test_model_layers.py``); qwen3_5 runs in ``test_qwen3_5.py`` on
:func:`seeded_runner`.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.harness import (
    assert_same_training,
    RunFailed,
    TEST_ARGS,
    torchrun,
    unpipelined_args,
)
from torchtitan_seq1f1b.integration import MAIN, titan_release
from tests.integration.titan_0_3 import adamw_kimi, fewer_experts, input_dtype_experts

# Model family: its debug config in torchtitan's registry, the steps each run trains,
# the job's own flags and the launchers that change the config.
MODELS = {
    "deepseek_v3": ("deepseek_v3_debugmodel", 3, (), ()),
    # One sequence per microbatch, and two steps, the second from the first's update.
    "qwen3_moe": ("qwen3_moe_debug", 2, (
        "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
    ), (fewer_experts.__name__,)),
    # Documents of 201 tokens drifting across rows of 256, so that the sliding windows
    # (128 keys) cut what a query sees, across segment borders.
    "gpt_oss": ("gpt_oss_debugmodel", 3, (
        "--training.seq_len", "256", "--dataloader.dataset_path", "doc_tokens=201,words=128",
        "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
    ), ()),
    # deepseek_v3's decoder under a MoonViT encoder, on the synthetic image-text corpus.
    "kimi_k2_5": ("kimi_k2_5_debugmodel", 3, ("--seq1f1b.data", "images"), (
        adamw_kimi.__name__,
    )),
}
# On main (its corpus no flag): 2 microbatches of one row of 256 tokens, each one
# 256-token recall document, for every model.
MAIN_MODEL_ARGS = (
    "--training.num_tokens_per_microbatch_per_dp_rank", "256",
    "--training.max_context_length", "256", "--parallelism.num_pp_microbatches", "2",
)
# kimi keeps its images on main: two 128-token documents to a microbatch's row.
MAIN_IMAGE_ARGS = ("--seq1f1b.data", "images", "--training.max_context_length", "128")
if titan_release() == MAIN:
    MODELS = {
        name: (config, steps, (*MAIN_MODEL_ARGS, *MAIN_IMAGE_ARGS * (name == "kimi_k2_5")),
               launchers)
        for name, (config, steps, _, launchers) in MODELS.items()
    }
DATA_ARGS = (
    "--seq1f1b.data", "recall", "--metrics.enable_tensorboard", *TEST_ARGS,
    "--optimizer.param-groups.0.optimizer-kwargs.lr", "3e-4",
    # float32 compute: one rank autocasts to bf16, which CPUs multiply slowly.
    "--training.mixed_precision_param", "float32",
)


def _steps_and_final_save(steps: int) -> tuple[str, ...]:
    """Train ``steps`` steps and save the model (with its persistent buffers) at the
    last one only, in float32 whatever the config exports."""
    return (
        "--training.steps", str(steps), "--checkpoint.interval", str(steps),
        "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32",
    )


def seeded_runner(tmp_path_factory, label: str, config: str, steps: int,
                  job_args: tuple[str, ...], launchers: tuple[str, ...]):
    """run(nproc, *args, name, more_launchers=()): a ``steps``-step run of torchtitan's
    ``config`` with ``job_args`` and ``launchers``, from one seed
    checkpoint written here; ``run.steps``: ``steps``."""
    config = f"torchtitan_seq1f1b:{config}"
    launchers = (*launchers, input_dtype_experts.__name__)
    seed = tmp_path_factory.mktemp(f"{label}_seed")
    torchrun(
        seed, 1, *DATA_ARGS, *job_args, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree", "1", "--debug.seed", "0", config=config,
        launchers=launchers,
    )

    def run(nproc, *args, name: str, more_launchers: tuple[str, ...] = ()):
        return torchrun(
            tmp_path_factory.mktemp(f"{label}_{name}"), nproc, *DATA_ARGS, *job_args,
            "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
            *_steps_and_final_save(steps), *args, config=config,
            launchers=(*more_launchers, *launchers),
        )

    run.steps = steps
    return run


@pytest.fixture(scope="module", params=list(MODELS))
def model_run(request, tmp_path_factory):
    """run(nproc, *args, name): a short run of the model's config from its seed
    checkpoint; ``run.steps``: the steps each run trains."""
    config, steps, job_args, launchers = MODELS[request.param]
    return seeded_runner(tmp_path_factory, request.param, config, steps, job_args, launchers)


@pytest.fixture(scope="module")
def model_unpipelined(model_run):
    return model_run(1, *unpipelined_args(), name="unpipelined")


# Expert parallelism shards the experts over the two data-parallel ranks of each stage.
# torchtitan's default SPMD backend (spmd_types) keeps its meshes per thread, so
# recompute on a backward's fresh thread finds none; the DTensor backend runs there.
EXPERT_PARALLEL_ARGS = (
    "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
    "--parallelism.spmd_backend", "partial_dtensor",
)


# deepseek_v3 and qwen3 share torchtitan's MoE and token dispatcher; deepseek_v3's is smaller.
@pytest.mark.parametrize("model_run", ["deepseek_v3"], indirect=True)
def test_expert_parallel_pp2_matches_expert_parallel(model_run):
    """EP=2 under Seq1F1B PP=2 (4 ranks) against EP=2 without PP: the same data
    shards and the same all-to-all of tokens to experts, per segment instead of
    per microbatch."""
    reference = model_run(2, *unpipelined_args(dp=2), *EXPERT_PARALLEL_ARGS, name="ep")
    pipelined = model_run(
        4, "--parallelism.pipeline_parallel_degree", "2", *EXPERT_PARALLEL_ARGS, name="ep_pp2"
    )
    assert "Seq1F1B" in pipelined.output
    assert_same_training(pipelined, reference, min_steps=model_run.steps)
    assert_same_expert_biases(pipelined, reference)


@pytest.mark.parametrize("model_run", ["deepseek_v3"], indirect=True)
def test_context_parallel_pp2_matches_unpipelined(model_run, model_unpipelined):
    """CP = 2 x PP = 2 (4 ranks): MLA's K/V gathered per segment, and the router's
    token counts summed over the CP ranks' shares."""
    pipelined = model_run(
        4, "--parallelism.pipeline_parallel_degree", "2",
        # Each CP rank's loss cuts its half of a segment into the loss's 8 chunks.
        "--parallelism.context_parallel_degree", "2", "--seq1f1b.align", "16", name="cp_pp2",
    )
    assert "context parallel 2 per segment" in pipelined.output
    assert_same_training(pipelined, model_unpipelined, min_steps=model_run.steps)
    assert_same_expert_biases(pipelined, model_unpipelined)


def test_model_pp2_matches_unpipelined(model_run, model_unpipelined):
    """Seq1F1B, k = 4 balanced segments: the job's defaults."""
    _assert_pp2_matches(model_run, model_unpipelined)


# qwen3_moe_debug, the largest, runs Seq1F1B only: the variants run on deepseek_v3 and
# gpt_oss, and all three route through torchtitan's one MoE module. deepseek_v3's
# chunked loss reshards its FSDP output head (and the final norm beside it) after every
# segment's forward, which a split backward must see through.
VARIANTS = {
    "deepseek_v3": (
        "--seq1f1b.schedule", "Seq1F1BZBV", "--parallelism.pipeline_parallel_schedule",
        "ZBVZeroBubble", "--seq1f1b.num_segments", "2", "activation_checkpoint:full",
    ),
    "gpt_oss": (
        "--seq1f1b.schedule", "InterleavedSeq1F1B", "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B", "--seq1f1b.num_segments", "2",
    ),
}


@pytest.mark.parametrize("model_run,schedule_args", list(VARIANTS.items()), indirect=["model_run"])
def test_model_variant_pp2_matches_unpipelined(model_run, model_unpipelined, schedule_args):
    _assert_pp2_matches(model_run, model_unpipelined, *schedule_args)


def _assert_pp2_matches(model_run, model_unpipelined, *schedule_args: str) -> None:
    pipelined = model_run(2, "--parallelism.pipeline_parallel_degree", "2", *schedule_args, name="pp2")
    assert "Using pipeline schedule" in pipelined.output and "Seq1F1B" in pipelined.output
    assert_same_training(pipelined, model_unpipelined, min_steps=model_run.steps)
    assert_same_expert_biases(pipelined, model_unpipelined)


def assert_same_expert_biases(run, reference_run) -> None:
    """Every MoE layer's expert bias ends equal, and load balancing moved some."""
    biases, reference = _expert_biases(run), _expert_biases(reference_run)
    assert biases.keys() == reference.keys() and reference
    for name, bias in reference.items():
        assert torch.equal(biases[name], bias), name
    assert any(bias.any() for bias in reference.values())


def _expert_biases(run) -> dict[str, torch.Tensor]:
    """Every MoE layer's ``expert_bias_E`` (experts,) at the run's last step, read
    alone from the model saved there (the run's one save)."""
    (saved,) = (run.dump_folder / "checkpoint").glob("step-*")
    entries = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    biases = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in entries.items()
        if name.endswith(".expert_bias_E")
    }
    dcp.load(biases, checkpoint_id=saved, no_dist=True)
    return biases


def test_a_config_neither_ours_nor_torchtitans_fails_naming_the_closest(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(tmp_path, 1, config="torchtitan_seq1f1b:qwen3_debugmodle", timeout=120)
    assert "--config qwen3_debugmodle is neither" in failure.value.output
    assert "'qwen3_debugmodel'" in failure.value.output


def test_missing_test_assets_are_refused_naming_the_data_option(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(tmp_path, 1, *TEST_ARGS, config="torchtitan_seq1f1b:llama3_debugmodel", timeout=120)
    output = failure.value.output
    assert "hf_assets_path='./tests/assets/tokenizer' does not exist" in output
    assert "--seq1f1b.data recall" in output

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's own model configs as Seq1F1B jobs (``--config <registry function>``).

Each model starts from its own seed checkpoint and trains on the shipped
recall corpus (``--seq1f1b.data recall``: torchtitan's debug configs read its
repository's test assets) with packed documents, under the config's own loss
and activation checkpointing. Seq1F1B PP=2 and a variant must match the
non-pipelined run on every step's loss and the step-1 grad_norm within 1e-4.
"""

import pytest

from tests.harness import assert_same_training, RunFailed, TEST_ARGS, torchrun

# Model family: its debug config in torchtitan's registry.
MODELS = {"llama3": "llama3_debugmodel"}
DATA_ARGS = ("--seq1f1b.data", "recall", "--metrics.enable_tensorboard", *TEST_ARGS)


def _config(model: str) -> str:
    return f"torchtitan_seq1f1b:{MODELS[model]}"


@pytest.fixture(scope="module", params=list(MODELS))
def model_run(request, tmp_path_factory):
    """run(nproc, *args, name): a short run of the model's config from its seed checkpoint."""
    config = _config(request.param)
    seed = tmp_path_factory.mktemp(f"{request.param}_seed")
    torchrun(
        seed, 1, *DATA_ARGS, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree", "1", "--debug.seed", "0", config=config,
    )

    def run(nproc, *args, name):
        return torchrun(
            tmp_path_factory.mktemp(f"{request.param}_{name}"), nproc, *DATA_ARGS,
            "--checkpoint.enable", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
            *args, config=config,
        )

    run.model = request.param
    return run


@pytest.fixture(scope="module")
def model_unpipelined(model_run):
    return model_run(1, "--parallelism.pipeline_parallel_degree", "1", name="unpipelined")


@pytest.mark.parametrize(
    "variant",
    [
        (),
        ("--seq1f1b.schedule", "InterleavedSeq1F1B",
         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--seq1f1b.num_segments", "2"),
    ],
    ids=["Seq1F1B-k4", "InterleavedSeq1F1B-k2"],
)
def test_model_pp2_matches_unpipelined(model_run, model_unpipelined, variant):
    pipelined = model_run(2, "--parallelism.pipeline_parallel_degree", "2", *variant, name="pp2")
    assert "Using pipeline schedule" in pipelined.output and "Seq1F1B" in pipelined.output
    assert_same_training(pipelined, model_unpipelined)


def test_a_config_neither_ours_nor_torchtitans_fails_naming_the_closest(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(tmp_path, 1, config="torchtitan_seq1f1b:qwen3_debugmodle", timeout=120)
    assert "--config qwen3_debugmodle is neither" in failure.value.output
    assert "'qwen3_debugmodel'" in failure.value.output


def test_missing_test_assets_are_refused_naming_the_data_option(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(tmp_path, 1, *TEST_ARGS, config=_config("llama3"), timeout=120)
    output = failure.value.output
    assert "hf_assets_path='./tests/assets/tokenizer' does not exist" in output
    assert "--seq1f1b.data recall" in output


def test_a_model_not_yet_verified_is_refused_naming_it(tmp_path):
    with pytest.raises(RunFailed) as failure:
        torchrun(
            tmp_path, 2, *DATA_ARGS, "--parallelism.pipeline_parallel_degree", "2",
            config="torchtitan_seq1f1b:qwen3_moe_debug", timeout=180,
        )
    assert "model 'qwen3': Seq1F1B supports ['llama3']" in failure.value.output

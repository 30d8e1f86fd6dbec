# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's qwen3_5 (three GatedDeltaNet layers to one softmax layer) as
Seq1F1B jobs (``--config qwen35_debugmodel``, ``qwen35_debugmodel_moe``).

Each config trains as a text decoder on the shipped recall corpus, from one
seed checkpoint, with its own chunked loss and selective checkpointing, at
the shipped tokenizer's 2048 tokens (:mod:`~tests.integration.titan_0_3.smaller_vocab`).
A pipelined run must match the non-pipelined one: every step's loss and the
step-1 grad_norm within 1e-4, and the MoE's expert biases bit for bit. Both
runs compute the GatedDeltaNet with this package's plain-torch recurrence on
CPU; under Seq1F1B its state and conv tail cross every segment cut.

The images flavour trains ``qwen35_debugmodel`` on the shipped image-text corpus
(``--seq1f1b.data images``): the vision encoder on the first stage, each image
encoded once per microbatch and its tokens' features scattered segment by
segment; its negative control numbers each segment's image tokens from its own
first one. CI runs Seq1F1B on every flavour; the other schedules are
``extended`` (``python -m pytest tests/integration/titan_0_3/test_qwen3_5.py -m extended``).
"""

import pytest

from tests.harness import (
    assert_same_training,
    largest_difference,
    TORCHTITAN_RTOL,
    unpipelined_args,
)
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED

from tests.integration.titan_0_3 import segment_local_images, smaller_vocab
from tests.integration.titan_0_3.test_models import assert_same_expert_biases, seeded_runner
from tests.integration.titan_0_3.test_torchtitan import seq1f1b_args

# One data-parallel rank, no TP or EP: the MoE config asks for 8 ranks.
SINGLE_RANK_PER_STAGE = (
    "--parallelism.data_parallel_shard_degree", "-1", "--parallelism.tensor_parallel_degree", "1",
    "--parallelism.expert_parallel_degree", "1",
)
# Config and flags of each flavour; three steps, the later ones from the first updates.
MODELS = {
    "dense": ("qwen35_debugmodel", ()),
    "moe": ("qwen35_debugmodel_moe", SINGLE_RANK_PER_STAGE),
    # The synthetic image-text corpus: two images a row, encoded on the first stage.
    # On main, 128-token documents as on 0.3: four to a packed 512-token microbatch.
    "images": ("qwen35_debugmodel", ("--seq1f1b.data", "images",
                                     *(("--training.max_context_length", "128") * FOLDED))),
}
FLAVOURS = list(MODELS)
PIPELINED = ("--parallelism.pipeline_parallel_degree", "2")


@pytest.fixture(scope="module", params=FLAVOURS)
def qwen_run(request, tmp_path_factory):
    config, job_args = MODELS[request.param]
    run = seeded_runner(
        tmp_path_factory, request.param, config, 3, job_args, (smaller_vocab.__name__,)
    )
    run.moe = request.param == "moe"
    run.config = config
    return run


@pytest.fixture(scope="module")
def qwen_unpipelined(qwen_run):
    return qwen_run(1, *unpipelined_args(config=qwen_run.config), name="unpipelined")


def _assert_matches(qwen_run, run, reference, schedule: str) -> None:
    assert f"Using pipeline schedule {schedule} on the stage layout" in run.output
    assert_same_training(run, reference)
    if qwen_run.moe:
        assert_same_expert_biases(run, reference)


def test_seq1f1b_pp2_matches_unpipelined(qwen_run, qwen_unpipelined):
    """Seq1F1B, k = 4 balanced segments: the job's defaults."""
    pipelined = qwen_run(2, *PIPELINED, name="pp2")
    _assert_matches(qwen_run, pipelined, qwen_unpipelined, "Seq1F1B")


@pytest.mark.parametrize("qwen_run", ["images"], indirect=True)
def test_segment_local_image_rows_fail(qwen_run, qwen_unpipelined):
    """Negative control: each segment's image tokens numbered from its own first one."""
    broken = qwen_run(
        2, *PIPELINED, name="segment_local", more_launchers=(segment_local_images.__name__,)
    )
    assert largest_difference(broken, qwen_unpipelined) > TORCHTITAN_RTOL


@pytest.mark.extended
@pytest.mark.parametrize("qwen_run", ["dense"], indirect=True)
def test_interleaved_pp2_matches_unpipelined(qwen_run, qwen_unpipelined):
    """Two stages per rank, k = 2: stages 0 (layers 0-1) and 2 (layers 5-6) hold
    GatedDeltaNet layers alone."""
    pipelined = qwen_run(
        2, *PIPELINED, *seq1f1b_args("InterleavedSeq1F1B"), "--seq1f1b.num_segments", "2",
        name="interleaved",
    )
    _assert_matches(qwen_run, pipelined, qwen_unpipelined, "InterleavedSeq1F1B")


@pytest.mark.extended
@pytest.mark.parametrize(
    "schedule, more_args",
    [("Seq1F1BZeroBubble", ("activation_checkpoint:full",)),
     ("Seq1F1BZBV", ("activation_checkpoint:none",))],
    ids=["zero_bubble_full_ac", "zbv"],
)
@pytest.mark.parametrize("qwen_run", ["dense", "images"], indirect=True)
def test_split_backward_pp2_matches_unpipelined(
    qwen_run, qwen_unpipelined, schedule, more_args
):

    """Input gradients (the state's and the conv tail's among them) before weight
    gradients; under full checkpointing every segment is recomputed in both. With
    images, the encoder's backward runs in segment 0's weight step."""
    pipelined = qwen_run(
        2, *PIPELINED, *seq1f1b_args(schedule), *more_args, name=schedule
    )
    _assert_matches(qwen_run, pipelined, qwen_unpipelined, schedule)

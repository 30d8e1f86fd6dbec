# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``attn_mask_type = "block_causal"`` under Seq1F1B, end to end on CPU with gloo.

torchtitan's debug flavor with flex attention and block-causal masks, on
packed recall documents that drift across windows (41-token documents in
129-token windows: every row of a microbatch has its own layout, documents
cross segment and window borders). The non-pipelined reference computes
torchtitan's masks with the segment-aware attention over whole windows
(flex cannot train on CPU); Seq1F1B and ZB-V must match it as the
causal runs of test_torchtitan.py do, and the comparison fails when the
pipelined run drops the document masks.
"""

import pytest

from tests.harness import (
    assert_same_training,
    largest_difference,
    TORCHTITAN_RTOL,
)

PACKED = "doc_tokens=41,words=64"
BLOCK_CAUSAL_ARGS = (
    "--model.flavor", "debugmodel_flex_attn",
    "--training.dataset_path", PACKED,
)
VALIDATION_ARGS = (
    "--validation.enable",
    "--validation.freq", "3",
    "--validation.steps", "2",
    "--validation.seq_len", "128",
    "--validation.dataset_path", PACKED,
)


@pytest.fixture(scope="module")
def unpipelined(run):
    return run(
        1,
        "--parallelism.pipeline_parallel_degree", "1",
        *BLOCK_CAUSAL_ARGS, *VALIDATION_ARGS,
        name="block_causal_unpipelined",
    )


@pytest.mark.parametrize(
    "schedule,args",
    [
        # The schedules' document handling is shared; these two cover one stage and two
        # per rank, the split backward and recompute (torchtitan 0.3's runs all four).
        ("Seq1F1B", ("--seq1f1b.num_segments", "4", *VALIDATION_ARGS)),
        ("Seq1F1BZBV", ("--seq1f1b.num_segments", "3", "--activation_checkpoint.mode", "full")),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_block_causal_pp2_matches_unpipelined(run, unpipelined, schedule, args):
    seq1f1b = run(
        2,
        *BLOCK_CAUSAL_ARGS,
        "--parallelism.pipeline_parallel_schedule", schedule,
        *args,
        name=schedule,
    )
    assert f"Using pipeline schedule {schedule} with 2 microbatches" in seq1f1b.output
    assert "attn_mask_type=block_causal" in seq1f1b.output
    print(f"{schedule}: largest relative difference {largest_difference(seq1f1b, unpipelined):.2e}")
    assert_same_training(seq1f1b, unpipelined)
    if "--validation.enable" in args:
        validation = seq1f1b.scalars("validation_metrics/loss")
        reference = unpipelined.scalars("validation_metrics/loss")
        assert {1, 3} <= set(validation) == set(reference)
        for step, loss in reference.items():
            assert validation[step] == pytest.approx(loss, rel=TORCHTITAN_RTOL), step


def test_tolerance_catches_a_dropped_document_mask(run, unpipelined):
    """Negative control: the pipelined run attends across documents (one
    document per row, i.e. causal over the window) and the comparison fails."""
    seq1f1b = run(
        2,
        *BLOCK_CAUSAL_ARGS,
        "--experimental.custom_import", "tests.integration.titan_0_2.broken_titan",
        name="document_mask",
        extra_env={"SEQ1F1B_BREAK": "document_mask"},
    )
    difference = largest_difference(seq1f1b, unpipelined)
    print(f"document mask dropped: largest relative difference {difference:.2e}")
    assert difference > 10 * TORCHTITAN_RTOL
    with pytest.raises(AssertionError):
        assert_same_training(seq1f1b, unpipelined)


def test_block_causal_context_parallel_pp2_matches_unpipelined(run, unpipelined):
    """CP = 2 x PP = 2 (4 ranks) under ZB-H1 with full checkpointing: document borders
    fall inside segments and inside the ranks' head-tail pieces, the split backward
    reduce-scatters dK/dV, and torchtitan's flex CP hooks never run."""
    seq1f1b = run(
        4, *BLOCK_CAUSAL_ARGS, "--parallelism.context_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Seq1F1BZeroBubble",
        "--seq1f1b.num_segments", "3", "--activation_checkpoint.mode", "full",
        name="context_parallel",
    )
    assert "attn_mask_type=block_causal, context parallel 2 per segment" in seq1f1b.output
    assert_same_training(seq1f1b, unpipelined)

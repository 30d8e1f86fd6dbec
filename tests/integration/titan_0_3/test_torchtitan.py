# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B inside torchtitan 0.3, end to end on CPU with gloo.

Every run starts from one seed checkpoint, with every backward on a fresh
thread (as CUDA runs it), on packed documents (41-token documents in
128-token windows; torchtitan 0.3 always masks documents). Per-step losses
and the step-1 grad_norm of pipelined runs must match the non-pipelined
run's within 1e-4 relative (FSDP2 and TP runs: FSDP2 alone's, TP alone's). The grad_norm catches
normalisation bugs -- torchtitan 0.3's loss divides by the global token
count, and the schedule must not divide again -- that clipping and Adam
would hide in the loss curve. Negative controls show that the comparison
fails when Seq1F1B is broken.
"""

import math

import pytest

from torchtitan_seq1f1b.planner import CACHE_ENV, GIB, NoPlanFitsError

from tests.harness import (
    assert_same_training,
    JOB_ROWS,
    JOB_TOKENS,
    JOB_TOKENS_OPTION,
    largest_difference,
    RESUME_STEPS,
    RunFailed,
    TEST_ARGS,
    TORCHTITAN_RTOL as RTOL,
    torchrun,
    unpipelined_args,
    VALIDATION_DATA_ARGS,
)
from tests.integration.attention_counts import counted_run
from tests.integration.calibration_cache import (
    expected_recommendation,
    TIME_MODEL,
    planner_job_target,
    write_calibration,
)

UNPIPELINED = unpipelined_args()
# Seq1F1B evaluates (forward only) with the training plan.
VALIDATION_ARGS = ("--validator.enable", "--validator.freq", "3", *VALIDATION_DATA_ARGS)
# Two pipelined validation steps; on main each is num_pp_microbatches (2) packed rows
# under PP and one row without, so the unpipelined run takes 4 steps for the same rows.
PIPELINED_VALIDATION_STEPS = ("--validator.steps", "2")
UNPIPELINED_VALIDATION_STEPS = ("--validator.steps", "4" if JOB_ROWS == 1 else "2")
LAYOUTS = {
    "Seq1F1B": "1F1B",
    "InterleavedSeq1F1B": "Interleaved1F1B",
    "Seq1F1BZeroBubble": "1F1B",
    "Seq1F1BZBV": "ZBVZeroBubble",
}


def seq1f1b_args(schedule: str) -> tuple[str, ...]:
    return (
        "--seq1f1b.schedule", schedule,
        "--parallelism.pipeline_parallel_schedule", LAYOUTS[schedule],
    )


@pytest.fixture(scope="module")
def unpipelined(run):
    return run(
        1, *UNPIPELINED, *VALIDATION_ARGS, *UNPIPELINED_VALIDATION_STEPS, name="unpipelined"
    )


@pytest.fixture(scope="module")
def fsdp_unpipelined(run):
    """FSDP2 alone: data parallelism shards the data, so FSDP runs are compared with FSDP."""
    return run(
        2, *unpipelined_args(dp=2), "--parallelism.data_parallel_shard_degree", "2", name="fsdp"
    )


@pytest.fixture(scope="module")
def tp_unpipelined(run):
    """Tensor parallelism alone: TP's numerics differ from a single process,
    so TP runs are compared with TP."""
    return run(2, *UNPIPELINED, "--parallelism.tensor_parallel_degree", "2", name="tp")


def test_torch_1f1b_matches_unpipelined(run, unpipelined):
    """torchtitan's own 1F1B (seq1f1b.schedule none) on the CPU attention: the
    reference path and the comparison agree where Seq1F1B is not involved."""
    torch_1f1b = run(2, "--seq1f1b.schedule", "none", name="torch_1f1b")
    assert "Using pipeline schedule 1F1B" in torch_1f1b.output
    assert_same_training(torch_1f1b, unpipelined)


@pytest.mark.parametrize(
    "schedule,segments,stages",
    [
        ("Seq1F1B", 4, 2),
        ("InterleavedSeq1F1B", 3, 4),
        ("Seq1F1BZeroBubble", 3, 2),
        ("Seq1F1BZBV", 2, 4),
    ],
)
def test_pp2_matches_unpipelined(run, unpipelined, schedule, segments, stages):
    seq1f1b = run(
        2,
        *seq1f1b_args(schedule),
        "--seq1f1b.num_segments", str(segments),
        *VALIDATION_ARGS,
        *PIPELINED_VALIDATION_STEPS,
        name=schedule,
    )
    assert (
        f"Using pipeline schedule {schedule} on the stage layout of {LAYOUTS[schedule]} "
        f"with 2 microbatches x {segments} segments"
    ) in seq1f1b.output
    assert f"over {stages} stages on 2 ranks" in seq1f1b.output
    assert_same_training(seq1f1b, unpipelined)
    validation = seq1f1b.scalars("validation_metrics/loss")
    reference = unpipelined.scalars("validation_metrics/loss")
    assert {1, 3} <= set(validation) == set(reference)
    for step, loss in reference.items():
        assert validation[step] == pytest.approx(loss, rel=RTOL), step
    lengths = [seq1f1b.scalars(f"seq1f1b/segment_len/{j}")[1] for j in range(segments)]
    assert sum(lengths) == JOB_TOKENS
    assert seq1f1b.scalars("seq1f1b/kv_store_peak_bytes")[1] > 0
    bubble = seq1f1b.scalars("seq1f1b/bubble_estimate")[1]
    p, m = 2, 2
    if schedule == "Seq1F1B":
        assert bubble == pytest.approx((p - 1) / (m * segments + p - 1))
    elif schedule == "InterleavedSeq1F1B":
        assert bubble == pytest.approx((p - 1) / (2 * m * segments + p - 1))
    else:
        assert 0 < bubble < (p - 1) / (m * segments + p - 1)


@pytest.fixture(scope="module")
def uncheckpointed_counts(run, tmp_path_factory):
    """Attention forwards per rank of a Seq1F1B job without checkpointing."""
    folder = tmp_path_factory.mktemp("counts")
    return counted_run(run, folder, 2, *seq1f1b_args("Seq1F1B"), name="uncheckpointed")[1]


@pytest.mark.parametrize(
    "schedule,ac",
    [("Seq1F1B", "activation_checkpoint:selective"), ("Seq1F1BZBV", "activation_checkpoint:full")],
)
def test_activation_checkpointing_matches_unpipelined(
    run, unpipelined, uncheckpointed_counts, tmp_path, schedule, ac
):
    """Recompute during backward (and, for the split backward, during input- and
    weight-gradient steps) sees the same segments and documents as the forward.
    Op-level selective checkpointing saves attention: it runs as often as
    without checkpointing."""
    seq1f1b, counts = counted_run(run, tmp_path, 2, *seq1f1b_args(schedule), ac,
                                  name=f"{schedule}_ac")
    assert "activation checkpointing to the model" in seq1f1b.output
    assert_same_training(seq1f1b, unpipelined)
    if schedule == "Seq1F1B":
        assert counts == uncheckpointed_counts


def test_fsdp_pp_matches_fsdp(run, fsdp_unpipelined):
    seq1f1b = run(4, "--parallelism.data_parallel_shard_degree", "2", name="fsdp_pp")
    assert_same_training(seq1f1b, fsdp_unpipelined)


def test_tp_cp_pp_matches_tp(run, tp_unpipelined):
    """TP = 2 x CP = 2 x PP = 2 (8 ranks): segments cut into multiples of tp x 2c, each
    CP piece sequence-parallel over the TP ranks."""
    seq1f1b = run(
        8, "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.context_parallel_degree", "2", name="tp_cp_pp",
    )
    assert "context parallel 2 per segment" in seq1f1b.output
    assert_same_training(seq1f1b, tp_unpipelined)


# Segments blind to earlier ones move the losses far more than these (the float64
# grids' negative controls catch them at 1e-10).
@pytest.mark.parametrize("broken", ["normalizer", "document_mask"])
def test_tolerance_catches_broken_seq1f1b(run, unpipelined, broken):
    """Negative control: gradients divided by one token too many (0.2%), or
    documents not masked, fail the 1e-4 comparison."""
    seq1f1b = run(
        2,
        config="tests.integration.titan_0_3.broken:seq1f1b_debug",
        name=broken,
        extra_env={"SEQ1F1B_BREAK": broken},
    )
    assert largest_difference(seq1f1b, unpipelined) > RTOL
    with pytest.raises(AssertionError):
        assert_same_training(seq1f1b, unpipelined)


def test_resume_continues_the_uninterrupted_run(run, tmp_path):
    uninterrupted = run(2, *RESUME_STEPS, "--checkpoint.interval", "2", name="uninterrupted", saves=True)
    resumed = torchrun(
        tmp_path, 2, *TEST_ARGS, *RESUME_STEPS,
        "--checkpoint.folder", str(uninterrupted.dump_folder / "checkpoint"),
        "--checkpoint.load_step", "2",
    )
    assert "Training starts at step 3" in resumed.output
    assert sorted(resumed.losses) == [3, 4]
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(uninterrupted.losses[step], rel=1e-6), step


# ---- the planner: num_segments = "auto" ---------------------------------------

PLANNER_ARGS = ("--seq1f1b.num_segments", "auto", "--seq1f1b.partition", "auto")


@pytest.fixture(scope="module")
def planner_cache(tmp_path_factory):
    """(cache folder, file, the job's dims): a made-up time model where the job will look for it
    (float32, 2-sequence microbatches, backend "auto"), so the choice is known."""
    from torchtitan.config import ConfigManager

    from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import transformer_cost

    config = ConfigManager().parse_args(
        ["--module", "torchtitan_seq1f1b", "--config", "seq1f1b_debug", *TEST_ARGS]
    )
    cost = transformer_cost(config.model_spec.model)
    folder = tmp_path_factory.mktemp("calibration")
    return folder, write_calibration(folder, planner_job_target(cost)), cost


def _recommendation(cost, budget_bytes):
    return expected_recommendation(
        cost, JOB_TOKENS, "Seq1F1B", num_ranks=2, stages_per_rank=1, microbatches=2,
        budget_bytes=budget_bytes,
    )


def test_auto_plan_within_the_budget_matches_unpipelined(run, unpipelined, planner_cache):
    """k and partition left to the planner under a memory_budget_gib the fastest
    plan exceeds: every rank runs the plan recommend() picks within it from the
    cached time model, and trains like the non-pipelined run."""
    folder, cache_file, cost = planner_cache
    fastest = _recommendation(cost, None).best
    # Just below the fastest plan's peak (in millionths of a GiB, as a flag gives it).
    budget_gib = math.floor((max(fastest.peak_bytes) - 1) / GIB * 1e6) / 1e6
    expected = _recommendation(cost, int(budget_gib * GIB)).best
    cache_file = write_calibration(folder, planner_job_target(cost, int(budget_gib * GIB)))
    assert (expected.num_segments, expected.partition) != (fastest.num_segments, fastest.partition)
    assert expected.num_segments not in (1, 4)  # neither k=1 nor the config's k
    lengths = list(expected.plan.lengths)
    planned = run(
        2, *PLANNER_ARGS, "--seq1f1b.memory_budget_gib", repr(budget_gib),
        name="auto", extra_env={CACHE_ENV: str(folder)},
    )
    output = planned.output
    chosen = (
        f"Seq1F1B planner (time model read from {cache_file}; {TIME_MODEL.describe()}): "
        f"k={expected.num_segments} "
        f"{expected.partition}, lengths {lengths}, predicted step {expected.step_seconds:.4f} s"
    )
    used = (
        f"Using pipeline schedule Seq1F1B on the stage layout of 1F1B with 2 microbatches "
        f"x {expected.num_segments} segments {lengths}"
    )
    # Once per rank (log lines carry no rank).
    assert output.count(chosen) == 2, [line for line in output.splitlines() if "planner" in line]
    assert output.count(f"within {budget_gib:.3f} GiB") == 2
    assert output.count(used) == 2
    logged = [
        planned.scalars(f"seq1f1b/segment_len/{j}")[1] for j in range(expected.num_segments)
    ]
    assert logged == lengths
    assert_same_training(planned, unpipelined)


def test_auto_plan_over_the_budget_fails_on_every_rank(tmp_path, planner_cache):
    """A memory_budget_gib no plan fits: both ranks raise the planner's error
    (rank 0 chose and told rank 1), neither hangs."""
    folder, _, cost = planner_cache
    budget_gib = 0.002
    # calibration chains fewer blocks within so small a budget
    write_calibration(folder, planner_job_target(cost, int(budget_gib * GIB)))
    with pytest.raises(NoPlanFitsError) as in_process:
        _recommendation(cost, int(budget_gib * GIB))
    with pytest.raises(RunFailed) as failure:
        torchrun(
            tmp_path, 2, *TEST_ARGS, *PLANNER_ARGS,
            "--seq1f1b.memory_budget_gib", str(budget_gib),
            timeout=120,
            extra_env={CACHE_ENV: str(folder)},
        )
    output = failure.value.output
    message = (
        "Seq1F1BConfigError: seq1f1b.num_segments='auto', seq1f1b.partition='auto', "
        f"seq1f1b.align=1 (x tp=1), {JOB_TOKENS_OPTION}={JOB_TOKENS}: "
        f"seq1f1b.memory_budget_gib={budget_gib}: {in_process.value}"
    )
    for rank in (0, 1):
        assert f"[rank{rank}]: torchtitan_seq1f1b.integration.segment_plan.{message}" in output, (
            output[-4000:]
        )
    assert "Training starts" not in output
    assert "Connection closed by peer" not in output

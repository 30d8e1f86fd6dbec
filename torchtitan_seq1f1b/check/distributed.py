# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Checks across processes: pipelined exactness and a short torchtitan job.

On CUDA they need 2 GPUs (4 for context parallelism inside the pipeline) and
talk NCCL; ``--device cpu`` runs them on gloo processes (what the test suite
does at length).
"""

import math
import tempfile
from pathlib import Path

import torch

from torchtitan_seq1f1b.local_ranks import run_ranks
from torchtitan_seq1f1b.check import relative_error, Result, Task, worst
from torchtitan_seq1f1b.examples.tiny_transformer import ACTIVATION_CHECKPOINT_MODES
from torchtitan_seq1f1b.check.exactness import (
    Case,
    context_parallel_cases,
    pipelined_cases,
    reference,
)
from torchtitan_seq1f1b.integration.schedules import SPLIT_BACKWARD_SCHEDULES
from torchtitan_seq1f1b.check.titan_runs import (
    DEBUG_CONFIG,
    RunFailed,
    TEST_ARGS,
    titan_release,
    torchrun,
)

__all__ = [
    "TORCHTITAN_ROW",
    "context_parallel_names",
    "context_parallel_results",
    "missing_gpus",
    "missing_torchtitan",
    "multi_gpu_tasks",
    "pipelined_names",
    "pipelined_results",
    "torchtitan_results",
]

WORLD_SIZE = 2
STAGES_PER_RANK = {"Seq1F1B": 1, "InterleavedSeq1F1B": 2, "Seq1F1BZeroBubble": 1, "Seq1F1BZBV": 2}
# torch.compile cannot run the split backward (pytorch#161904); the adapters refuse it.
COMPILED_SCHEDULES = ("Seq1F1B", "InterleavedSeq1F1B")
FLOAT64_BOUND = 1e-10  # the schedules reorder float64 sums; nothing else differs
TORCHTITAN_BOUND = 1e-4  # float32 losses and step-1 grad_norm, as in the tests
TORCHTITAN_ROW = f"torchtitan Seq1F1B PP={WORLD_SIZE} vs 1 process"
# Context parallelism inside each of the WORLD_SIZE pipeline ranks: CP x PP ranks.
CP_DEGREE = 2
CP_WORLD_SIZE = CP_DEGREE * WORLD_SIZE
CP_CHECKPOINT_MODES = ("none", "full")


def missing_gpus(device: torch.device, ranks: int = WORLD_SIZE) -> str:
    """Why checks on ``ranks`` ranks cannot run on ``device`` for want of GPUs; "" if
    they can."""
    if device.type == "cuda" and torch.cuda.device_count() < ranks:
        return f"needs {ranks} GPUs (found {torch.cuda.device_count()})"
    return ""


def missing_torchtitan() -> str:
    """Why :func:`torchtitan_results` cannot run for want of torchtitan; "" if it can."""
    return "" if titan_release() else "needs torchtitan (not installed)"


def _case(
    device: torch.device, schedule: str, mode: str, lengths: tuple[int, ...], compile: bool = False
) -> Case:
    return Case(
        n_microbatches=3,
        lengths=lengths,
        n_kv_heads=2,
        activation_checkpoint=mode,
        schedule=schedule,
        stages_per_rank=STAGES_PER_RANK[schedule],
        device=device.type,
        # CUDA runs backward on its device thread itself.
        device_thread=device.type == "cpu",
        compile=compile,
    )


def _cases(device: torch.device) -> list[Case]:
    """Every schedule x checkpointing mode; on CUDA also compiled blocks under the
    schedules compile supports (:data:`COMPILED_SCHEDULES`)."""
    eager = [
        _case(device, schedule, mode, (5, 3, 4))
        for schedule in STAGES_PER_RANK
        for mode in ACTIVATION_CHECKPOINT_MODES
        # Op-level checkpointing allows one backward per region; a split backward runs two.
        if not (mode == "selective_op" and schedule in SPLIT_BACKWARD_SCHEDULES)
    ]
    if device.type != "cuda":  # on CPU the test suite runs the compiled grid
        return eager
    return eager + [
        _case(device, schedule, mode, (5, 3, 4), compile=True)
        for schedule in COMPILED_SCHEDULES
        for mode in ("full", "selective_op")
    ]


def _context_parallel_cases(device: torch.device) -> list[Case]:
    """Every schedule with and without checkpointing, on segment lengths CP can cut
    (multiples of ``2 * CP_DEGREE``)."""
    return [
        _case(device, schedule, mode, (8, 4, 12))
        for schedule in STAGES_PER_RANK
        for mode in CP_CHECKPOINT_MODES
    ]


def _compare(case: Case, ranks: list[dict]) -> float:
    """Largest relative error of gradients, summed losses and eval logits."""
    ref = reference(case)
    grads = {name: grad for rank in ranks for name, grad in rank["grads"].items()}
    if grads.keys() != ref["grads"].keys():
        return math.inf
    losses = next(rank["losses"] for rank in ranks if rank["losses"])
    logits = next(rank["logits"] for rank in ranks if rank["logits"] is not None)
    return worst([
        relative_error(sum(losses), ref["loss_sum"]),
        relative_error(logits, ref["logits"]),
        *(relative_error(grads[name], ref["grads"][name]) for name in grads),
    ])


def _compare_context_parallel(case: Case, ranks: list[dict]) -> float:
    """Largest relative error of gradients and per-microbatch loss sums; every rank
    holds its CP group's sums, so each stage's gradients come from its CP rank 0."""
    ref = reference(case)
    grads = {
        name: grad for rank in ranks if rank["cp_rank"] == 0 for name, grad in rank["grads"].items()
    }
    if grads.keys() != ref["grads"].keys():
        return math.inf
    losses = next(rank["losses"] for rank in ranks if rank["last"])
    return worst([
        relative_error(losses, torch.stack(ref["loss_sums"])),
        *(relative_error(grads[name], ref["grads"][name]) for name in grads),
    ])


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _row_name(case: Case, backend: str) -> str:
    compiled = " compiled" if case.compile else ""
    return (
        f"pipelined {case.schedule}{compiled} ac={case.activation_checkpoint} "
        f"({WORLD_SIZE} ranks, {backend})"
    )


def _context_parallel_row_name(case: Case, backend: str) -> str:
    return (
        f"pipelined CP={CP_DEGREE} x PP={WORLD_SIZE} {case.schedule} "
        f"ac={case.activation_checkpoint} ({CP_WORLD_SIZE} ranks, {backend})"
    )


def context_parallel_names(device: torch.device) -> list[str]:
    """The rows :func:`context_parallel_results` reports on ``device``, one per case."""
    backend = _backend(device)
    return [_context_parallel_row_name(case, backend) for case in _context_parallel_cases(device)]


def _pipeline_parallel_names(device: torch.device) -> list[str]:
    return [_row_name(case, _backend(device)) for case in _cases(device)]


def pipelined_names(device: torch.device) -> list[str]:
    """The rows :func:`pipelined_results` reports on ``device``, one per case."""
    return _pipeline_parallel_names(device) + context_parallel_names(device)


def _bounded_rows(
    device: torch.device, names: list[str], ranks: int, worker, cases: list[Case], compare, *args
) -> list[Result]:
    """Each case's row from one launch of ``worker(rank, ranks, cases, *args)``: its
    ``compare`` error against :data:`FLOAT64_BOUND`; skipped without ``ranks`` GPUs;
    failed, every row, if a rank crashes."""
    if missing := missing_gpus(device, ranks):
        return [Result(name, "skip", reason=missing) for name in names]
    try:
        per_rank = run_ranks(worker, ranks, cases, *args, timeout=900, backend=_backend(device))
    except Exception as crash:  # noqa: BLE001 - every case failed with it
        reason = f"{type(crash).__name__}: {str(crash)[-500:]}"
        return [Result(name, "fail", reason=reason) for name in names]
    return [
        Result.bounded(name, compare(case, [rank[i] for rank in per_rank]), FLOAT64_BOUND)
        for i, (name, case) in enumerate(zip(names, cases))
    ]


def context_parallel_results(device: torch.device) -> list[Result]:
    """Every schedule with and without checkpointing under CP = 2 inside PP = 2 (4
    ranks), float64, against unsplit training."""
    cases = _context_parallel_cases(device)
    names = context_parallel_names(device)
    return _bounded_rows(
        device, names, CP_WORLD_SIZE, context_parallel_cases, cases,
        _compare_context_parallel, CP_DEGREE,
    )


def _pipeline_parallel_results(device: torch.device) -> list[Result]:
    """Every schedule x checkpointing mode on 2 ranks, float64, against unsplit training."""
    names = _pipeline_parallel_names(device)
    return _bounded_rows(device, names, WORLD_SIZE, pipelined_cases, _cases(device), _compare)


def pipelined_results(device: torch.device) -> list[Result]:
    """:func:`_pipeline_parallel_results`, then :func:`context_parallel_results`."""
    return _pipeline_parallel_results(device) + context_parallel_results(device)


def torchtitan_results(device: torch.device) -> list[Result]:
    """torchtitan's llama3 debug model: Seq1F1B PP=2 against one process, from
    one seed checkpoint; per-step losses and the step-1 grad_norm."""
    name = TORCHTITAN_ROW
    if missing := missing_gpus(device) or missing_torchtitan():
        return [Result(name, "skip", reason=missing)]
    if titan_release() == "0.2" and not DEBUG_CONFIG.exists():
        return [Result(name, "skip", reason=f"needs a source checkout ({DEBUG_CONFIG} not found)")]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            torchrun(
                folder / "seed", 1, *TEST_ARGS,
                "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                "--parallelism.pipeline_parallel_degree", "1",
            )
            from_seed = (
                *TEST_ARGS,
                "--checkpoint.enable",
                "--checkpoint.initial_load_path", str(folder / "seed" / "checkpoint" / "step-0"),
                "--checkpoint.interval", "1000",
            )
            single = torchrun(
                folder / "single", 1, *from_seed, "--parallelism.pipeline_parallel_degree", "1"
            )
            seq1f1b = torchrun(
                folder / "seq1f1b", WORLD_SIZE, *from_seed,
                "--parallelism.pipeline_parallel_degree", str(WORLD_SIZE),
            )
            losses, ref_losses = seq1f1b.losses, single.losses
            grad_norm, ref_grad_norm = seq1f1b.grad_norms.get(1), single.grad_norms.get(1)
    except (RunFailed, OSError) as crash:
        return [Result(name, "fail", reason=f"{type(crash).__name__}: {str(crash)[-500:]}")]
    if not ref_losses or sorted(losses) != sorted(ref_losses) or grad_norm is None:
        return [Result(name, "fail", reason=f"logged steps differ: {sorted(losses)} vs {sorted(ref_losses)}")]
    errors = [abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in ref_losses]
    errors.append(abs(grad_norm - ref_grad_norm) / abs(ref_grad_norm))
    steps = sorted(ref_losses)
    return [
        Result.bounded(
            name, worst(errors), TORCHTITAN_BOUND,
            steps=len(steps), loss_first=losses[steps[0]], loss_last=losses[steps[-1]],
        )
    ]


def multi_gpu_tasks(device: torch.device) -> list[Task]:
    """:func:`pipelined_results` and :func:`torchtitan_results` as tasks that run on
    GPUs only, 2 (4 for :func:`context_parallel_results`); their CPU runs on gloo are
    the test suite's."""

    def gpus(ranks: int) -> str:
        if device.type == "cuda":
            return missing_gpus(device, ranks)
        return f"needs {ranks} GPUs (on CPU: --checks pipelined,torchtitan runs it on gloo)"

    return [
        Task(
            tuple(_pipeline_parallel_names(device)),
            lambda: _pipeline_parallel_results(device),
            unmet=gpus(WORLD_SIZE),
        ),
        Task(
            tuple(context_parallel_names(device)),
            lambda: context_parallel_results(device),
            unmet=gpus(CP_WORLD_SIZE),
        ),
        Task(
            (TORCHTITAN_ROW,),
            lambda: torchtitan_results(device),
            unmet="; ".join(filter(None, (gpus(WORLD_SIZE), missing_torchtitan()))),
        ),
    ]

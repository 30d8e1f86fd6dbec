# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A llama3-shaped stack run segment by segment against unsplit training.

One microbatch of a small :class:`TinyTransformer` (RoPE at global positions,
GQA, SwiGLU, RMSNorm) runs as one Seq1F1B stage runs it: every segment's
forward in order, then every segment's backward, last first, each with its
own share of the mean loss (:class:`SegmentedRun`). On CUDA the backward runs
on autograd's device thread; on CPU a fresh thread per backward reproduces
that. Every activation checkpointing mode is run; the gradients must equal
those of the same model trained unsplit.

float32 (TF32 off) is compared with unsplit float32. bf16 is compared with
the float32 gradients too, and may be off by at most twice what unsplit bf16
training is off by.
"""

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn as nn

from torchtitan_seq1f1b.check import relative_error, Result, run_tasks, Task, worst
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.examples.tiny_transformer import (
    ACTIVATION_CHECKPOINT_MODES,
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["stack_results", "stack_tasks", "tf32_off"]

# head_dim 64 with 4 query heads per K/V head, and head_dim 128 with 2.
MODELS = {
    "d64": TinyTransformerArgs(
        vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=1, ffn_hidden_dim=512
    ),
    "d128": TinyTransformerArgs(
        vocab_size=256, dim=256, n_layers=4, n_heads=2, n_kv_heads=1, ffn_hidden_dim=512
    ),
}
BATCH = 2
# On CUDA, 4 segments of 2048 tokens with equal FLOPs (uneven lengths); on
# CPU a short uneven plan keeps the check quick.
GPU_PLAN = (2048, 4)
CPU_LENGTHS = (44, 28, 24)
# float32: the segmented run sums the same terms in another order (per
# segment, prefix blocks); float32 keeps 24 bits (eps 1.2e-7) and summation
# order moves gradients by ~1e-6 norm-wise. A segment that misses its prefix
# is off by O(0.1).
FLOAT32_BOUND = 1e-4
# bf16 against the float32 reference: unsplit bf16 training is itself off by
# some e (bf16 weights and activations); the segmented run rounds the same
# values and may be off by at most 2e.
BF16_FACTOR = 2.0
MIB = 2**20


class _SegmentLoss(nn.Module):
    """A segment's share of the microbatch's mean loss: its token-loss sum / valid tokens."""

    def __init__(self, model: TinyTransformer, valid_tokens: int):
        super().__init__()
        self.model, self.valid_tokens = model, valid_tokens

    def forward(self, tokens, target, positions):
        return token_sum_cross_entropy(self.model(tokens, positions), target) / self.valid_tokens


def _batch(args: TinyTransformerArgs, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (BATCH, seq_len), generator=gen)
    target = torch.randint(0, args.vocab_size, (BATCH, seq_len), generator=gen)
    target[torch.rand(BATCH, seq_len, generator=gen) < 0.15] = -100
    return tokens.to(device), target.to(device)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _with_mode(model: TinyTransformer, mode: str) -> TinyTransformer:
    model.args = dataclasses.replace(model.args, activation_checkpoint=mode)
    return model


def unsplit(model: TinyTransformer, tokens, target) -> tuple[dict, torch.Tensor]:
    """Gradients and mean loss of the whole sequence in one pass."""
    loss = token_sum_cross_entropy(model(tokens), target) / (target != -100).sum()
    loss.backward()
    return _grads(model), loss.detach()


def segmented(model: TinyTransformer, tokens, target, plan: SegmentPlan) -> tuple[dict, torch.Tensor, dict]:
    """Gradients, mean loss and peak memory per segment (MiB; CUDA only) of a
    segment-by-segment run."""
    device = tokens.device
    run = SegmentedRun(
        _SegmentLoss(model, int((target != -100).sum())),
        [tokens, target],
        plan,
        KVStore(),
        positions_kwarg="positions",
    )
    peaks: dict[str, list[float]] = {"forward": [], "backward": []}

    @contextlib.contextmanager
    def measured(phase: str):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peaks[phase].append(round(torch.cuda.max_memory_allocated(device) / MIB, 1))

    for segment in range(plan.num_segments):
        with measured("forward"):
            run.forward(segment)
    # CUDA runs backward on its device thread; on CPU a fresh thread stands in.
    with backward_on_fresh_thread(enabled=device.type != "cuda"):
        for segment in reversed(range(plan.num_segments)):
            with measured("backward"):
                run.backward(segment)
    run.store.free(run.microbatch)
    peaks["backward"].reverse()  # segment order
    loss = sum(out.detach() for out in run.outs)
    return _grads(model), loss, peaks


def _error(grads: dict, loss, ref_grads: dict, ref_loss) -> float:
    errors = [relative_error(grads[n], ref_grads[n]) for n in ref_grads]
    return worst([relative_error(loss, ref_loss), *errors])


def _model(args: TinyTransformerArgs, dtype, device) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(args).to(device=device, dtype=dtype)


def _plan(args: TinyTransformerArgs, device: torch.device) -> SegmentPlan:
    if device.type == "cuda":
        return SegmentPlan.balanced(*GPU_PLAN, args.cost())
    return SegmentPlan.from_lengths(CPU_LENGTHS)


def _row_name(name: str, dtype: torch.dtype, mode: str) -> str:
    return f"stack {name} {str(dtype).removeprefix('torch.')} ac={mode}"


def _rows(name: str, args: TinyTransformerArgs, device: torch.device) -> list[Result]:
    plan = _plan(args, device)
    tokens, target = _batch(args, plan.seq_len, device)
    reference = _model(args, torch.float32, device)
    ref_grads, ref_loss = unsplit(reference, tokens, target)
    low = _model(args, torch.bfloat16, device)
    low_grads, low_loss = unsplit(low, tokens, target)
    bf16_bound = BF16_FACTOR * _error(low_grads, low_loss, ref_grads, ref_loss)
    results = []
    for mode in ACTIVATION_CHECKPOINT_MODES:
        for dtype, model, bound in (
            (torch.float32, reference, FLOAT32_BOUND),
            (torch.bfloat16, low, bf16_bound),
        ):
            row = _row_name(name, dtype, mode)
            try:
                grads, loss, peaks = segmented(_with_mode(model, mode), tokens, target, plan)
            except Exception as crash:  # noqa: BLE001 - reported as a failed row
                model.zero_grad(set_to_none=True)
                results.append(Result(row, "fail", reason=f"{type(crash).__name__}: {crash}"))
                continue
            finally:
                _with_mode(model, "none")
            memory = (
                {"peak_mib_fwd": peaks["forward"], "peak_mib_bwd": peaks["backward"]}
                if device.type == "cuda"
                else {"peak_mib": "n/a"}
            )
            error = _error(grads, loss, ref_grads, ref_loss)
            results.append(Result.bounded(row, error, bound, segments=list(plan.lengths), **memory))
    return results


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    """float32 matmuls and convolutions in full float32 within the block."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _task(name: str, args: TinyTransformerArgs, device: torch.device) -> Task:
    names = tuple(
        _row_name(name, dtype, mode)
        for mode in ACTIVATION_CHECKPOINT_MODES
        for dtype in (torch.float32, torch.bfloat16)
    )

    def run() -> list[Result]:
        with tf32_off():
            return _rows(name, args, device)

    return Task(names, run)


def stack_tasks(device: torch.device) -> list[Task]:
    """One task per model of :data:`MODELS`: its rows share one unsplit reference."""
    return [_task(name, args, device) for name, args in MODELS.items()]


def stack_results(device: torch.device) -> list[Result]:
    return run_tasks(stack_tasks(device))

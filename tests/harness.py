# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Multi-process gloo runs for tests, and the unsplit reference they compare to."""

from dataclasses import dataclass

import torch
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleSeq1F1BZBV,
    ScheduleSeq1F1BZeroBubble,
    SegmentAwareAttention,
    SegmentPlan,
)
from torchtitan_seq1f1b._launch import RankFailure, run_ranks  # noqa: F401 - used by tests
from tests.device_thread import backward_on_fresh_thread
from tests.kernel_fakes import stand_in_backend
from torchtitan_seq1f1b.examples.tiny_transformer import (
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)


SCHEDULES = {
    "Seq1F1B": ScheduleSeq1F1B,
    "InterleavedSeq1F1B": ScheduleInterleavedSeq1F1B,
    "Seq1F1BZeroBubble": ScheduleSeq1F1BZeroBubble,
    "Seq1F1BZBV": ScheduleSeq1F1BZBV,
}


@dataclass(frozen=True)
class Case:
    """One exactness configuration of the tiny transformer."""

    n_microbatches: int
    lengths: tuple[int, ...]
    n_kv_heads: int = 4
    activation_checkpoint: str = "none"  # ACTIVATION_CHECKPOINT_MODES
    microbatch_size: int = 2
    schedule: str = "Seq1F1B"
    stages_per_rank: int = 1
    n_layers: int = 4
    # Every backward on a fresh thread, as CUDA's autograd engine runs it.
    device_thread: bool = True
    # "exact", or a GPU kernel's adapter run through its CPU stand-in
    # ("flash", "varlen", "cuda_exact"; see tests/kernel_fakes.py).
    kernel: str = "exact"

    @property
    def plan(self) -> SegmentPlan:
        return SegmentPlan.from_lengths(self.lengths)

    @property
    def model_args(self) -> TinyTransformerArgs:
        return TinyTransformerArgs(
            n_layers=self.n_layers,
            n_kv_heads=self.n_kv_heads,
            activation_checkpoint=self.activation_checkpoint,
            attention_backend="sdpa",
        )

    def model(self) -> TinyTransformer:
        torch.manual_seed(0)
        return TinyTransformer(self.model_args).double()

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, target: (n_microbatches * microbatch_size, seq_len); some targets ignored."""
        gen = torch.Generator().manual_seed(1)
        shape = (self.n_microbatches * self.microbatch_size, sum(self.lengths))
        tokens = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target = torch.randint(0, self.model_args.vocab_size, shape, generator=gen)
        target[torch.rand(shape, generator=gen) < 0.15] = -100
        return tokens, target


def reference(case: Case) -> dict:
    """Unsplit, non-pipelined loss, gradients and logits in one process."""
    model = case.model()
    tokens, target = case.batch()
    logits = model(tokens)
    loss_sum = token_sum_cross_entropy(logits, target)
    (loss_sum / (target != -100).sum()).backward()
    return {
        "loss_sum": loss_sum.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "logits": logits.detach(),
    }


def pipelined(
    rank: int, world_size: int, case: Case, loss_normalizer: float | None = None
) -> dict:
    """One training step and one eval() of ``case.schedule`` on this rank's stages.

    Stages ``rank + c * world_size`` for each chunk c (loop placement), or
    ``rank`` and ``2 * world_size - 1 - rank`` for the V of Seq1F1BZBV.
    """
    model = case.model()
    num_stages = world_size * case.stages_per_rank
    if case.schedule == "Seq1F1BZBV":
        indices = [rank, num_stages - 1 - rank]
    else:
        indices = [rank + c * world_size for c in range(case.stages_per_rank)]
    parts = [model.stage(i, num_stages) for i in indices]
    stand_in = None
    if case.kernel != "exact":
        backend, stand_in = stand_in_backend(case.kernel)
        for part in parts:
            for module in part.modules():
                if isinstance(module, SegmentAwareAttention):
                    module.backend = backend
    stages = [
        PipelineStage(part, i, num_stages, torch.device("cpu"))
        for part, i in zip(parts, indices)
    ]
    schedule = SCHEDULES[case.schedule](
        stages,
        case.n_microbatches,
        case.plan,
        loss_fn=token_sum_cross_entropy,
        positions_kwarg="positions",
    )
    schedule.loss_normalizer = loss_normalizer
    tokens, target = case.batch()
    inputs = (tokens,) if rank == 0 else ()
    has_last = indices[-1] == num_stages - 1
    losses: list = []
    with backward_on_fresh_thread(case.device_thread):
        schedule.step(*inputs, target=target if has_last else None, losses=losses)
    stores = [schedule.kv_stores[i] for i in indices]
    result = {
        "grads": {n: p.grad.clone() for part in parts for n, p in part.named_parameters()},
        "losses": [loss.clone() for loss in losses],
        "kv_left_after_step": sum(len(store) for store in stores),
        "kv_peak_bytes": max(store.peak_bytes for store in stores),
        # Sequence length of every chunk's activation and gradient receive buffer.
        "recv_lens": [
            [info.buffer.shape[1] for info in infos if info.buffer is not None]
            for stage in stages
            for recv in (stage.args_recv_info, stage.grad_recv_info)
            for infos in (recv[chunk] for chunk in sorted(recv))
        ],
    }
    # Attention calls that went through the kernel stand-in (training step only).
    result["kernel_calls"] = len(stand_in.calls) if stand_in is not None else None
    with torch.no_grad():
        logits = schedule.eval(*inputs, target=target if has_last else None)
    result["logits"] = logits.clone() if has_last else None
    result["kv_left_after_eval"] = sum(len(store) for store in stores)
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]

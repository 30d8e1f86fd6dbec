# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Multi-process gloo runs for tests, and the unsplit reference they compare to."""

import multiprocessing
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import ScheduleSeq1F1B, SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import (
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(worker, rank, world_size, port, results, args):
    torch.set_num_threads(1)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        # Plain pickle: tensors travel by value, not through shared memory
        # that dies with this process.
        results.put((rank, "ok", pickle.dumps(worker(rank, world_size, *args))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailure(RuntimeError):
    """Raised in the parent with every failing rank's error."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"[rank {r}] {e}" for r, e in sorted(errors.items())))


def run_ranks(worker: Callable, world_size: int, *args, timeout: float = 300) -> list:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns each rank's result; raises RankFailure if any rank raised and
    TimeoutError (after killing every rank) if they do not all finish.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(worker, rank, world_size, port, results, args))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, object]] = {}
    try:
        while len(outcomes) < world_size:
            rank, status, value = results.get(timeout=timeout)
            outcomes[rank] = (status, value)
    except queue.Empty:
        raise TimeoutError(
            f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish "
            f"in {timeout}s (hang); finished: {outcomes}"
        ) from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RankFailure(errors)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


@dataclass(frozen=True)
class Case:
    """One exactness configuration of the tiny transformer."""

    n_microbatches: int
    lengths: tuple[int, ...]
    n_kv_heads: int = 4
    activation_checkpoint: bool = False
    microbatch_size: int = 2

    @property
    def plan(self) -> SegmentPlan:
        return SegmentPlan.from_lengths(self.lengths)

    @property
    def model_args(self) -> TinyTransformerArgs:
        return TinyTransformerArgs(
            n_layers=4,
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
    """One Seq1F1B training step and one eval() on this rank's stage."""
    part = case.model().stage(rank, world_size)
    stage = PipelineStage(part, rank, world_size, torch.device("cpu"))
    schedule = ScheduleSeq1F1B(
        stage,
        case.n_microbatches,
        case.plan,
        loss_fn=token_sum_cross_entropy,
        positions_kwarg="positions",
    )
    schedule.loss_normalizer = loss_normalizer
    tokens, target = case.batch()
    inputs = (tokens,) if rank == 0 else ()
    is_last = rank == world_size - 1
    losses: list = []
    schedule.step(*inputs, target=target if is_last else None, losses=losses)
    store = schedule.kv_stores[rank]
    result = {
        "grads": {n: p.grad.clone() for n, p in part.named_parameters()},
        "losses": [loss.clone() for loss in losses],
        "kv_left_after_step": len(store),
        "kv_peak_bytes": store.peak_bytes,
        # Sequence length of every chunk's activation and gradient receive buffer.
        "recv_lens": [
            [info.buffer.shape[1] for info in infos if info.buffer is not None]
            for recv in (stage.args_recv_info, stage.grad_recv_info)
            for infos in (recv[chunk] for chunk in sorted(recv))
        ],
    }
    with torch.no_grad():
        logits = schedule.eval(*inputs, target=target if is_last else None)
    result["logits"] = logits.clone() if is_last else None
    result["kv_left_after_eval"] = len(store)
    return result


def pipelined_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [pipelined(rank, world_size, case) for case in cases]

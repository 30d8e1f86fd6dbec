# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Train a small transformer with ScheduleSeq1F1B on CPU (gloo).

    torchrun --nproc_per_node 2 -m torchtitan_seq1f1b.examples.train_tiny

Each sequence is random tokens whose second half repeats the first half, so
the loss on the second half only falls if attention reaches back across
segment boundaries. Nothing is downloaded.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from torchtitan_seq1f1b import ScheduleSeq1F1B, SegmentPlan
from torchtitan_seq1f1b.examples.tiny_transformer import (
    TinyTransformer,
    TinyTransformerArgs,
    token_sum_cross_entropy,
)


def copy_task_batch(
    batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, target: (batch_size, seq_len); the second half repeats the first."""
    half = torch.randint(0, vocab_size, (batch_size, seq_len // 2 + 1), generator=generator)
    sequence = torch.cat([half, half], dim=1)[:, : seq_len + 1]
    return sequence[:, :-1], sequence[:, 1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--num-segments", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--partition", choices=("balanced", "uniform"), default="balanced")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_args = TinyTransformerArgs(vocab_size=32, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128)
    if args.partition == "balanced":
        plan = SegmentPlan.balanced(args.seq_len, args.num_segments, model_args.cost())
    else:
        plan = SegmentPlan.uniform(args.seq_len, args.num_segments)

    torch.manual_seed(0)
    part = TinyTransformer(model_args).stage(rank, world_size)
    stage = PipelineStage(part, rank, world_size, torch.device("cpu"))
    schedule = ScheduleSeq1F1B(
        stage, args.microbatches, plan, loss_fn=token_sum_cross_entropy, positions_kwarg="positions"
    )
    optimizer = torch.optim.AdamW(part.parameters(), lr=args.lr)
    is_last = rank == world_size - 1
    if is_last:
        print(f"Seq1F1B: {world_size} stages, {args.microbatches} microbatches, {plan}", flush=True)

    generator = torch.Generator().manual_seed(1)
    batch_size = args.microbatches * args.microbatch_size
    first_loss = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, target = copy_task_batch(batch_size, args.seq_len, model_args.vocab_size, generator)
        optimizer.zero_grad()
        losses: list = []
        schedule.step(
            *((tokens,) if rank == 0 else ()),
            target=target if is_last else None,
            losses=losses,
        )
        optimizer.step()
        if is_last:
            loss = sum(losses).item() / int((target != -100).sum())
            first_loss = loss if first_loss is None else first_loss
            if step == 1 or step % 10 == 0 or step == args.steps:
                print(f"step {step:4d}  loss {loss:.4f}", flush=True)
    if is_last:
        elapsed = time.perf_counter() - start
        print(
            f"done: loss {first_loss:.4f} -> {loss:.4f} in {args.steps} steps "
            f"({elapsed / args.steps * 1000:.0f} ms/step); peak K/V store "
            f"{schedule.kv_stores[rank].peak_bytes / 2**10:.0f} KiB",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

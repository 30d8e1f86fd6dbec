# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What the K/V store holds for one attention layer and microbatch, with and without a window.

Drives a layer's store as the registered op does (every segment's forward, then every
backward last to first, with zero gradients) at a real model's K/V shape, and reports the
store's peak bytes and the keys the segments read. No attention is computed: what the
store holds does not depend on the values.

    python -m benchmarks.window_kv                       # gpt-oss-20b's K/V, 32k and 128k
    python -m benchmarks.window_kv --seq-len 8192 -k 4 --window 128
"""

import argparse

import torch

from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import SegmentAwareAttention
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.segmenting import SegmentPlan

MIB = 2**20


def store_peak(plan: SegmentPlan, window: int | None, n_kv_heads: int, head_dim: int, dtype):
    """(peak bytes of the store, keys read by all segments) for one layer and microbatch."""
    layer = SegmentAwareAttention("sdpa", window_left=None if window is None else window - 1)
    store = KVStore()
    banks, keys_read = [], 0
    for segment, length in enumerate(plan.lengths):
        kv = torch.zeros(1, length, n_kv_heads, head_dim, dtype=dtype)
        with store.running_unit(RunningUnit(Unit(0, segment), plan)):
            keys, _, bank, _ = store.prefix(layer, kv, kv, write=True)
        keys_read += keys.shape[1]
        banks.append((segment, bank, keys.shape))
    for segment, bank, shape in reversed(banks):
        with store.running_unit(RunningUnit(Unit(0, segment), plan)):
            bank(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    return store.peak_bytes, keys_read


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("-k", "--num-segments", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--window", type=int, default=128, help="keys a query sees, itself included")
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    print(
        f"K/V store of one layer, one microbatch: {args.n_kv_heads} K/V heads x {args.head_dim}, "
        f"bf16, window {args.window} keys"
    )
    print("| seq_len | k | full: peak MiB | window: peak MiB | full / window | keys read, full / window |")
    print("|---|---|---|---|---|---|")
    for seq_len in args.seq_len:
        for k in args.num_segments:
            plan = SegmentPlan.uniform(seq_len, k)
            shape = (args.n_kv_heads, args.head_dim, torch.bfloat16)
            full, full_keys = store_peak(plan, None, *shape)
            windowed, window_keys = store_peak(plan, args.window, *shape)
            print(
                f"| {seq_len} | {k} | {full / MIB:.1f} | {windowed / MIB:.2f} | "
                f"{full / windowed:.0f}x | {full_keys / window_keys:.2f}x |"
            )


if __name__ == "__main__":
    main()

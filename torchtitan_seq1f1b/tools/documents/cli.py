# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.tools.documents``: Seq1F1B under packed documents, as tables.

Samples windows from a packed stream of documents (seeded: the same options
print the same numbers), cuts them with uniform and FLOP-balanced segment
plans, and prints two markdown tables: attention pairs (FLOPs) with the
document mask against the dense causal prefix, per segment; and the K/V
bytes a store keeps, per (layer, microbatch) and at rank 0's peak, against
the whole-sequence store.
"""

import argparse
from collections.abc import Sequence

from torchtitan_seq1f1b.documents import keys_per_query
from torchtitan_seq1f1b.segmenting import PackedDocumentsCost, SegmentPlan
from torchtitan_seq1f1b.tools.documents.measure import (
    attention_pairs_per_segment,
    kv_rows_kept,
    rank_kv_peak_rows,
)
from torchtitan_seq1f1b.tools.documents.sampling import sample_document_ids
from torchtitan_seq1f1b.tools.model_shapes import get_preset, MODEL_PRESETS
from torchtitan_seq1f1b.tools.simulate.cli import document_lengths, positive_int

__all__ = ["main"]

GIB = 2**30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.tools.documents",
        description=(
            "Attention FLOPs and K/V store bytes of Seq1F1B with document-masked attention "
            "against the dense causal prefix, on windows sampled from a packed stream of "
            "documents; segment plans: uniform, balanced for dense causal attention "
            "(causal-balanced) and balanced for the documents' expected cost (balanced)."
        ),
    )
    parser.add_argument("--documents", type=document_lengths, default="lognormal:2048",
                        metavar="SPEC",
                        help="document lengths: lognormal:MEAN[:SIGMA] or fixed:LENGTH "
                             "(default lognormal:2048)")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="llama3-8b")
    parser.add_argument("--seq-len", type=positive_int, default=32768)
    parser.add_argument("--pp", type=positive_int, default=4, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=positive_int, default=8)
    parser.add_argument("--segments", "-k", type=positive_int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batch-size", type=positive_int, nargs="+", default=[1, 2],
                        help="rows per microbatch; the store keeps what any row needs")
    parser.add_argument("--steps", type=positive_int, default=16,
                        help="sampled steps (of -m microbatches) the K/V peak is averaged over")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _plans(args, cost: PackedDocumentsCost, k: int) -> dict[str, SegmentPlan]:
    return {
        "uniform": SegmentPlan.uniform(args.seq_len, k),
        "causal-balanced": SegmentPlan.balanced(args.seq_len, k, cost.model),
        "balanced": SegmentPlan.balanced(args.seq_len, k, cost),
    }


def _flops_table(args, ids, cost: PackedDocumentsCost) -> None:
    measured = PackedDocumentsCost.from_keys(cost.model, keys_per_query(ids))
    whole = measured.forward_flops(args.seq_len, args.seq_len)
    dense = cost.model.forward_flops(args.seq_len, args.seq_len)
    print(f"\nAttention pairs with the document mask / dense causal prefix, {ids.shape[0]} "
          f"windows; the whole forward (projections, MLP, LM head too): {whole / dense:.3f} "
          "of dense.\n")
    print("| k | plan | segment lengths | masked / dense pairs per segment | all segments "
          "| forward FLOPs max / mean, masked | same, dense |")
    print("|---|---|---|---|---|---|---|")
    for k in args.segments:
        for name, plan in _plans(args, cost, k).items():
            pairs = attention_pairs_per_segment(ids, plan)
            ratios = " ".join(f"{m / d:.3f}" for m, d in pairs)
            total = sum(m for m, _ in pairs) / sum(d for _, d in pairs)
            print(f"| {k} | {name} | {list(plan.lengths)} | {ratios} | {total:.3f} "
                  f"| {_imbalance(plan, measured):.3f} | {_imbalance(plan, cost.model):.3f} |")


def _imbalance(plan: SegmentPlan, cost) -> float:
    flops = plan.segment_flops(cost)
    return max(flops) * len(flops) / sum(flops)


def _kv_table(args, ids, cost: PackedDocumentsCost) -> None:
    model = cost.model
    layers = -(-model.n_layers // args.pp)  # rank 0 holds the first, largest stage
    row_bytes = layers * 2 * model.kv_dim * 2  # K and V, bf16
    print(f"\nK/V store with the document mask / whole sequence: positions kept per (layer, "
          f"microbatch), and rank 0's peak over a Seq1F1B step (pp={args.pp}, "
          f"m={args.microbatches}, {layers} layers, bf16, {args.steps} sampled steps).\n")
    print("| k | plan | microbatch size | kept per microbatch: mean (min-max) "
          "| rank-0 K/V GiB, masked: mean (max) | dense | masked / dense |")
    print("|---|---|---|---|---|---|---|")
    for k in (k for k in args.segments if k > 1):
        for name, plan in _plans(args, cost, k).items():
            for b in args.micro_batch_size:
                kept = [
                    kv_rows_kept(ids[i * b:(i + 1) * b], plan)
                    for i in range(args.steps * args.microbatches)
                ]
                steps = [kept[s:s + args.microbatches]
                         for s in range(0, len(kept), args.microbatches)]
                peaks = [rank_kv_peak_rows(step, args.pp, k) * b * row_bytes for step in steps]
                dense = rank_kv_peak_rows([args.seq_len] * args.microbatches, args.pp, k)
                dense *= b * row_bytes
                mean_peak = sum(peaks) / len(peaks)
                fractions = [n / args.seq_len for n in kept]
                print(f"| {k} | {name} | {b} | {sum(fractions) / len(fractions):.3f} "
                      f"({min(fractions):.3f}-{max(fractions):.3f}) | {mean_peak / GIB:.2f} "
                      f"({max(peaks) / GIB:.2f}) | {dense / GIB:.2f} | {mean_peak / dense:.3f} |")


def main(argv: Sequence[str] | None = None) -> int:
    """Print both tables for ``argv`` (default ``sys.argv[1:]``); 0 on success."""
    parser = _parser()
    args = parser.parse_args(argv)
    label, documents = args.documents
    for k in args.segments:
        if k > args.seq_len:
            parser.error(f"-k {k} is more segments than --seq-len {args.seq_len} tokens")
    cost = PackedDocumentsCost.expected(get_preset(args.model), documents, args.seq_len)
    rows = args.steps * args.microbatches * max(args.micro_batch_size)
    ids = sample_document_ids(documents, rows, args.seq_len, args.seed)
    print(f"{args.model}, seq_len={args.seq_len}, documents {label} (mean {documents.mean:.0f} "
          f"tokens), {rows} sampled windows, seed {args.seed}")
    _flops_table(args, ids, cost)
    _kv_table(args, ids, cost)
    return 0

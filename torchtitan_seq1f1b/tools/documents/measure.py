# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a document mask saves per segment: attention pairs, and the K/V rows a store keeps."""

import torch

from torchtitan_seq1f1b.documents import attention_pairs, MicrobatchDocuments
from torchtitan_seq1f1b.orders import seq1f1b_order
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["attention_pairs_per_segment", "kv_rows_kept", "rank_kv_peak_rows"]


def attention_pairs_per_segment(ids: torch.Tensor, plan: SegmentPlan) -> list[tuple[int, int]]:
    """``(document-masked, dense causal)`` (query, key) pairs of each segment, summed over rows.

    Masked pairs are what varlen kernels compute (each query's own document up
    to itself); dense pairs are the whole causal prefix a plain Seq1F1B
    segment attends. Attention FLOPs are proportional to both.

    Args:
        ids: document ids (rows, seq_len).
        plan: the segments of ``[0, seq_len)``.
    """
    rows = ids.shape[0]
    spans = list(zip(plan.offsets, plan.ends))
    return [
        (masked, rows * (end * (end + 1) - start * (start + 1)) // 2)
        for masked, (start, end) in zip(attention_pairs(ids, spans), spans)
    ]


def kv_rows_kept(ids: torch.Tensor, plan: SegmentPlan) -> int:
    """Positions a microbatch's K/V store keeps: from the first key a later segment reads back.

    Args:
        ids: document ids of one microbatch (microbatch size, seq_len).
        plan: at least two segments (with one there is no store).
    """
    if plan.num_segments < 2:
        raise ValueError("one segment keeps no K/V store; use num_segments >= 2")
    return plan.seq_len - MicrobatchDocuments(ids, plan).keep_from


def rank_kv_peak_rows(kept: list[int], num_stages: int, num_segments: int, rank: int = 0) -> int:
    """Peak over a Seq1F1B step of the K/V positions ``rank`` stores, summed over microbatches.

    A microbatch's store lives from its first forward on the rank to the
    backward of its segment 0 (what the simulator's memory model walks).

    Args:
        kept: positions each microbatch keeps (:func:`kv_rows_kept`); one per microbatch.
    """
    live: dict[int, int] = {}
    peak = 0
    for action in seq1f1b_order(num_stages, len(kept), num_segments)[rank]:
        microbatch, segment = action.unit
        if action.kind == "F" and segment == 0:
            live[microbatch] = kept[microbatch]
            peak = max(peak, sum(live.values()))
        elif action.kind == "B" and segment == 0:
            del live[microbatch]
    return peak

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

import torch

from benchmarks.window_kv import main, store_peak
from torchtitan_seq1f1b.segmenting import SegmentPlan


def test_store_peak_counts_tails_and_bank():
    """4 segments of 32, window of 9 keys: 3 tails of 8 positions (bf16), kept until the
    microbatch is freed, and from the last segment's backward an fp32 bank of 8. Without a
    window: the sequence and a bank of 96."""
    plan = SegmentPlan.uniform(128, 4)
    position = 2 * 3 * 4  # k and v of one position: 3 heads x 4, per byte of element
    windowed, window_keys = store_peak(plan, 9, 3, 4, torch.bfloat16)
    assert windowed == 3 * 8 * position * 2 + 8 * position * 4
    assert window_keys == 32 + 3 * (32 + 8)
    full, full_keys = store_peak(plan, None, 3, 4, torch.bfloat16)
    assert full == 128 * position * 2 + 96 * position * 4
    assert full_keys == 32 + 64 + 96 + 128


def test_the_table_prints(capsys):
    main(["--seq-len", "256", "-k", "2", "4", "--window", "16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 2

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Keyword inputs cut with the segments: qwen3_5's mrope positions (batch, seq_len, 3)
are cut along the sequence dim, their trailing dim kept; a (num_images, patches,
patch_dim) tensor goes to every segment whole, also where its patches number seq_len
if it is named whole."""

import torch

from torchtitan_seq1f1b.segmenting import SegmentPlan
from torchtitan_seq1f1b.stepping.segment_inputs import SegmentSplitter

PLAN = SegmentPlan.from_lengths((4, 4, 5, 3))


def test_mrope_positions_are_cut_along_the_sequence():
    positions = torch.arange(2 * 16 * 3).view(2, 16, 3)
    splitter = SegmentSplitter(PLAN, seq_dim=1, positions_kwarg="positions")
    segments = splitter.split_kwargs({"positions": positions}, torch.device("cpu"))
    assert [s["positions"].shape for s in segments] == [(2, n, 3) for n in PLAN.lengths]
    for segment, start, length in zip(segments, PLAN.offsets, PLAN.lengths):
        assert torch.equal(segment["positions"], positions[:, start : start + length])


def test_image_inputs_go_to_every_segment_whole():
    pixel_values = torch.randn(3, 5, 12)
    splitter = SegmentSplitter(PLAN, seq_dim=1)
    segments = splitter.split_kwargs({"pixel_values": pixel_values}, torch.device("cpu"))
    assert all(s["pixel_values"] is pixel_values for s in segments)


def test_kwargs_named_whole_are_not_cut_even_when_sequence_shaped():
    pixel_values = torch.randn(3, PLAN.seq_len, 12)  # as many patches as tokens
    cut = SegmentSplitter(PLAN, seq_dim=1).split_kwargs(
        {"pixel_values": pixel_values}, torch.device("cpu")
    )
    assert [s["pixel_values"].shape[1] for s in cut] == list(PLAN.lengths)
    splitter = SegmentSplitter(PLAN, seq_dim=1, whole_kwargs=frozenset({"pixel_values"}))
    whole = splitter.split_kwargs({"pixel_values": pixel_values}, torch.device("cpu"))
    assert all(s["pixel_values"] is pixel_values for s in whole)

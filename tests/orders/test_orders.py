# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B compute orders, the segment action type and the order checker."""

import itertools
from collections import Counter

import pytest
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from torchtitan_seq1f1b import (
    interleaved_seq1f1b_order,
    SegmentAction,
    ScheduleOrderError,
    seq1f1b_order,
    seq1f1b_zbv_order,
    seq1f1b_zero_bubble_order,
    validate_order,
)
from torchtitan_seq1f1b.orders import lower_order, v_stage_to_rank

GRID = list(itertools.product(range(1, 9), range(1, 9), range(1, 9)))


def _order(rows: dict[int, str]) -> dict[int, list[SegmentAction]]:
    return {r: [SegmentAction.from_str(a) for a in row.split()] for r, row in rows.items()}


def test_paper_example_p4_m2_k4():
    expected = _order({
        0: "0F0.0 0F0.1 0F0.2 0F0.3 0F1.0 0F1.1 0F1.2 0B0.3 0F1.3 0B0.2 0B0.1 0B0.0 0B1.3 0B1.2 0B1.1 0B1.0",
        1: "1F0.0 1F0.1 1F0.2 1F0.3 1F1.0 1F1.1 1B0.3 1F1.2 1B0.2 1F1.3 1B0.1 1B0.0 1B1.3 1B1.2 1B1.1 1B1.0",
        2: "2F0.0 2F0.1 2F0.2 2F0.3 2F1.0 2B0.3 2F1.1 2B0.2 2F1.2 2B0.1 2F1.3 2B0.0 2B1.3 2B1.2 2B1.1 2B1.0",
        3: "3F0.0 3F0.1 3F0.2 3F0.3 3B0.3 3F1.0 3B0.2 3F1.1 3B0.1 3F1.2 3B0.0 3F1.3 3B1.3 3B1.2 3B1.1 3B1.0",
    })
    assert seq1f1b_order(4, 2, 4) == expected


@pytest.mark.parametrize("p,m,k", GRID, ids=lambda v: str(v))
def test_every_generated_order_is_valid(p, m, k):
    order = seq1f1b_order(p, m, k)
    validate_order(order, p, m, k)
    for rank, actions in order.items():
        # Warmup forwards, plus the first steady-state forward if there is one.
        forwards_first = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert forwards_first == min(m * k, (p - rank - 1) + (k - 1) + 1)


class _RecordingStage:
    """Just enough of a stage for torch's 1F1B loop to run; records compute calls."""

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_last = stage_index == num_stages - 1
        self.calls: list[SegmentAction] = []

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(SegmentAction(self.stage_index, "F", mb, 0))

    def backward_one_chunk(self, mb, **kwargs):
        self.calls.append(SegmentAction(self.stage_index, "B", mb, 0))

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, factor):
        pass

    def release_fwd_send_outputs(self, mb):  # torch 2.15 drops sent outputs
        pass


class _TracedSchedule1F1B(Schedule1F1B):
    def _initialize_stage(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 9) for m in range(p, 9)])
def test_one_segment_is_torch_1f1b(p, m):
    """k=1 runs exactly the compute sequence torch's own 1F1B loop executes."""
    for rank in range(p):
        stage = _RecordingStage(rank, p)
        _TracedSchedule1F1B(stage, m)._step_microbatches([()] * m, [{}] * m)
        assert seq1f1b_order(p, m, 1)[rank] == stage.calls


def test_segment_action_string_round_trip():
    action = SegmentAction(0, "F", 1, 2)
    assert str(action) == "0F1.2"
    assert SegmentAction.from_str("0F1.2") == action
    lowered = action.lower(num_segments=4)
    assert (lowered.stage_index, lowered.microbatch_index) == (0, 6)
    assert SegmentAction.from_action(lowered, num_segments=4) == action


@pytest.mark.parametrize("text", ["0F1", "F1.2", "0X1.2", "0F1.2.3", ""])
def test_segment_action_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="not a segment action"):
        SegmentAction.from_str(text)


def test_segment_action_rejects_bad_fields():
    with pytest.raises(ValueError, match="kind"):
        SegmentAction(0, "Q", 0, 0)
    with pytest.raises(ValueError, match="out of range"):
        SegmentAction(0, "F", 0, 4).lower(num_segments=4)


def _mutated(p, m, k, rank, mutate):
    order = seq1f1b_order(p, m, k)
    order[rank] = mutate(list(order[rank]))
    return order


def _swap(actions, first, second):
    i, j = actions.index(SegmentAction.from_str(first)), actions.index(SegmentAction.from_str(second))
    actions[i], actions[j] = actions[j], actions[i]
    return actions


@pytest.mark.parametrize(
    "order,match",
    [
        (_mutated(2, 2, 3, 0, lambda a: _swap(a, "0B0.2", "0B0.1")), "last to first"),
        (_mutated(2, 2, 3, 1, lambda a: _swap(a, "1F0.0", "1F0.1")), "order"),
        (_mutated(2, 2, 3, 1, lambda a: a[:-1]), "exactly one backward"),
        (_mutated(2, 2, 3, 1, lambda a: a + [a[0]]), "runs twice"),
        (_mutated(2, 2, 3, 0, lambda a: [SegmentAction(1, x.kind, *x.unit) for x in a]), "another rank"),
        (
            _order({0: "0F0.0 0B0.0 0F1.0 0B1.0", 1: "1F0.0 1F1.0 1B0.0 1B1.0"}),
            "deadlock",
        ),
    ],
    ids=["segment-backward-order", "forward-order", "missing-backward", "duplicate", "wrong-rank", "deadlock"],
)
def test_checker_rejects_bad_orders(order, match):
    p = len(order)
    m = 1 + max(a.microbatch for acts in order.values() for a in acts)
    k = 1 + max(a.segment for acts in order.values() for a in acts)
    with pytest.raises(ScheduleOrderError, match=match):
        validate_order(order, p, m, k)


# ---- interleaved ---------------------------------------------------------------


def _interleaved_segment_counts(p: int) -> list[int]:
    """k 1..8; at p > 4, where checks cost most, the k that shape an order's warm-up
    and rounds: 1, 2, and just below, at and above p."""
    if p <= 4:
        return list(range(1, 9))
    return [k for k in sorted({1, 2, p - 1, p, p + 1}) if k <= 8]


@pytest.mark.parametrize("p,v", itertools.product(range(2, 9), range(2, 5)), ids=str)
def test_every_interleaved_order_is_valid(p, v):
    """m 1..12 and k 1..8 (thinned at p > 4), with loop placement."""
    for m, k in itertools.product(range(1, 13), _interleaved_segment_counts(p)):
        order = interleaved_seq1f1b_order(p, v, m, k)
        validate_order(order, p * v, m, k, stage_to_rank=lambda s: s % p)


def test_interleaved_warmup_extends_torch_by_k_minus_1():
    """Rounds of whole microbatches: warmup (v-1)*round + 2*(p-1-r) + (k-1)."""
    p, v, m, k = 4, 2, 8, 2  # 16 units in 4 rounds of 4 = 2 microbatches
    order = interleaved_seq1f1b_order(p, v, m, k)
    for rank, actions in order.items():
        warmup = next(i for i, a in enumerate(actions) if a.kind == "B") - 1
        assert warmup == (v - 1) * 4 + 2 * (p - 1 - rank) + (k - 1)


class _PlacedStage:
    """The attributes torch's multi-stage schedules read while building an order."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None


@pytest.mark.parametrize(
    "p,v,m",
    [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in range(1, 13) if m % max(1, m // p) == 0],
    ids=str,
)
def test_one_segment_is_torch_interleaved_1f1b(p, v, m):
    """k=1 is exactly torch's Interleaved1F1B order, for every m torch accepts."""
    ours = lower_order(interleaved_seq1f1b_order(p, v, m, 1), 1)
    for rank in range(p):
        stages = [_PlacedStage(rank + c * p, p * v, p, rank) for c in range(v)]
        torch_order = ScheduleInterleaved1F1B(stages, m).pipeline_order[rank]
        assert [str(a) for a in ours[rank]] == [str(a) for a in torch_order if a is not None]


# ---- zero bubble -------------------------------------------------------------


@pytest.mark.parametrize("p,m,k", GRID, ids=lambda v: str(v))
def test_every_zero_bubble_order_is_valid(p, m, k):
    order = seq1f1b_zero_bubble_order(p, m, k)
    validate_order(order, p, m, k)
    plain = seq1f1b_order(p, m, k)
    for rank, actions in order.items():
        assert Counter(a.kind for a in actions) == {"F": m * k, "I": m * k, "W": m * k}
        # Forwards and input gradients keep Seq1F1B's relative order.
        assert [(a.kind, a.unit) for a in actions if a.kind != "W"] == [
            ("I" if a.kind == "B" else "F", a.unit) for a in plain[rank]
        ]
        # No rank holds more units awaiting W than Seq1F1B's rank 0 holds awaiting B.
        in_flight = peak = 0
        for a in actions:
            in_flight += {"F": 1, "I": 0, "W": -1}[a.kind]
            peak = max(peak, in_flight)
        assert peak <= min(m * k, p + k - 1)


def test_zero_bubble_p4_m2_k2():
    """Rank r defers W by warmup_0 - warmup_r; the deferred ones fill the tail."""
    expected = _order({
        0: "0F0.0 0F0.1 0F1.0 0F1.1 0I0.1 0W0.1 0I0.0 0W0.0 0I1.1 0W1.1 0I1.0 0W1.0",
        3: "3F0.0 3F0.1 3I0.1 3F1.0 3I0.0 3F1.1 3I1.1 3I1.0 3W0.1 3W0.0 3W1.1 3W1.0",
    })
    order = seq1f1b_zero_bubble_order(4, 2, 2)
    assert {r: order[r] for r in expected} == expected


def test_checker_rejects_first_stage_weight_gradients_out_of_segment_order():
    """Stage 0 computes its whole backward in W: segment j's W needs j+1's first."""
    order = seq1f1b_zero_bubble_order(2, 1, 2)
    order.update(_order({0: "0F0.0 0F0.1 0I0.1 0I0.0 0W0.0 0W0.1"}))
    with pytest.raises(ScheduleOrderError, match="weight gradient before segment 1"):
        validate_order(order, 2, 1, 2)


# ---- V (ZB-V style) ------------------------------------------------------------


@pytest.mark.parametrize("p", range(2, 9))
def test_every_zbv_order_is_valid_within_seq1f1b_memory(p):
    for m, k in itertools.product(range(1, 13), range(1, 9)):
        order = seq1f1b_zbv_order(p, m, k)
        validate_order(order, 2 * p, m, k, stage_to_rank=v_stage_to_rank(p))
        for rank, actions in order.items():
            assert {a.stage for a in actions} == {rank, 2 * p - 1 - rank}
            in_flight = peak = 0
            for a in actions:
                in_flight += {"F": 1, "I": 0, "W": -1}[a.kind]
                peak = max(peak, in_flight)
            # Half-stage units awaiting W: Seq1F1B's rank-0 peak of p+k-1 whole ones.
            assert peak <= 2 * (p + k - 1)


@pytest.mark.parametrize("p", range(1, 7))
def test_one_segment_is_torch_zbv(p):
    """k=1 is exactly torch's ZBVZeroBubble order, for every m (torch pads m to 2p-1)."""
    for m in range(1, 13):
        ours = lower_order(seq1f1b_zbv_order(p, m, 1), 1)
        for rank in range(p):
            stages = [_PlacedStage(s, 2 * p, p, rank) for s in (rank, 2 * p - 1 - rank)]
            torch_order = ScheduleZBVZeroBubble(stages, m).pipeline_order[rank]
            assert [str(a) for a in ours[rank]] == [str(a) for a in torch_order if a is not None]


def test_zbv_p2_m2_k2():
    """Chunk 1 runs lead = r + k - 1 forwards ahead of its first I; W follows I at once."""
    expected = _order({
        0: "0F0.0 0F0.1 0F1.0 3F0.0 0F1.1 3F0.1 3I0.1 3W0.1 3F1.0 3I0.0 3W0.0 0I0.1 0W0.1 "
           "3F1.1 3I1.1 3W1.1 0I0.0 3I1.0 0I1.1 0W0.0 0I1.0 0W1.1 3W1.0 0W1.0",
        1: "1F0.0 2F0.0 1F0.1 2F0.1 1F1.0 2F1.0 2I0.1 2W0.1 1F1.1 1I0.1 1W0.1 2F1.1 2I0.0 "
           "2W0.0 1I0.0 2I1.1 1I1.1 2I1.0 1I1.0 1W0.0 2W1.1 2W1.0 1W1.1 1W1.0",
    })
    assert seq1f1b_zbv_order(2, 2, 2) == expected

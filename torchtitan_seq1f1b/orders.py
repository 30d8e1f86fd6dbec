# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B per-rank compute orders and the checker every order must pass.

Notation: p ranks, v stages (model chunks) per rank, m microbatches, k
segments, rank r. On every stage, forwards run in unit order (0,0), (0,1),
..., (m-1,k-1) and backwards are FIFO over microbatches and LIFO over
segments, since segment j's K/V gradients come from segments j+1..k-1.

- :func:`seq1f1b_order` (v = 1): rank r runs ``min(m*k, (p-r-1) + (k-1))``
  warmup forwards, then one-forward-one-backward pairs, then the remaining
  backwards. With k = 1 this is exactly torch's 1F1B order.
- :func:`interleaved_seq1f1b_order` (v >= 2, stage ``c*p + r`` on rank r):
  torch's interleaved 1F1B over the m*k units, whose warmup grows by the
  forwards a rank must run before its first backward is possible (k - 1
  more when rounds hold whole microbatches). With k = 1 it is exactly
  torch's Interleaved1F1B order.
- :func:`seq1f1b_zero_bubble_order` (v = 1): Seq1F1B with every backward
  split into an input-gradient (I) and a weight-gradient (W) action; W runs
  deferred so that it fills bubbles, ZB-H1 style, within 1F1B's memory.
- :func:`seq1f1b_zbv_order` (v = 2, stages r and 2p-1-r on rank r): split
  backwards on a V, ZB-V style, by list scheduling.
- :func:`gpipe_order`: every forward, then every backward (for comparison).
"""

from collections import defaultdict
from collections.abc import Callable

from torchtitan_seq1f1b._torch_compat import _add_send_recv, _simulate_comms_compute
from torchtitan_seq1f1b.actions import SegmentAction

__all__ = [
    "ScheduleOrderError",
    "gpipe_order",
    "interleaved_seq1f1b_order",
    "lower_order",
    "seq1f1b_order",
    "seq1f1b_zbv_order",
    "seq1f1b_zero_bubble_order",
    "v_stage_to_rank",
    "validate_order",
]

Order = dict[int, list[SegmentAction]]


class ScheduleOrderError(ValueError):
    """A compute order that is incomplete, misordered or would deadlock."""


Unit = tuple[int, int]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


def _forward_units(n_microbatches: int, num_segments: int) -> list[Unit]:
    return [(i, j) for i in range(n_microbatches) for j in range(num_segments)]


def _backward_units(n_microbatches: int, num_segments: int) -> list[Unit]:
    return [
        (i, j)
        for i in range(n_microbatches)
        for j in reversed(range(num_segments))
    ]


def _one_forward_one_backward(
    forwards: list[SegmentAction], backwards: list[SegmentAction], warmup: int
) -> list[SegmentAction]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    actions = forwards[:warmup]
    pending = iter(backwards)
    for forward in forwards[warmup:]:
        actions += [forward, next(pending)]
    actions.extend(pending)
    return actions


def _seq1f1b_warmup(num_stages: int, rank: int, n_units: int, num_segments: int) -> int:
    return min(n_units, (num_stages - rank - 1) + (num_segments - 1))


def seq1f1b_order(num_stages: int, n_microbatches: int, num_segments: int) -> Order:
    """The Seq1F1B order of every rank, one stage per rank."""
    _check_positive(
        num_stages=num_stages, n_microbatches=n_microbatches, num_segments=num_segments
    )
    units = _forward_units(n_microbatches, num_segments)
    backward_units = _backward_units(n_microbatches, num_segments)
    return {
        rank: _one_forward_one_backward(
            [SegmentAction(rank, "F", *u) for u in units],
            [SegmentAction(rank, "B", *u) for u in backward_units],
            _seq1f1b_warmup(num_stages, rank, len(units), num_segments),
        )
        for rank in range(num_stages)
    }


def gpipe_order(num_stages: int, n_microbatches: int, num_segments: int = 1) -> Order:
    """GPipe: every forward in unit order, then every backward.

    Backwards are FIFO over microbatches and LIFO over segments, the order the
    segment checker requires (torch's ScheduleGPipe for ``num_segments = 1``).
    """
    units = _forward_units(n_microbatches, num_segments)
    backward = _backward_units(n_microbatches, num_segments)
    return {
        rank: [SegmentAction(rank, "F", *u) for u in units]
        + [SegmentAction(rank, "B", *u) for u in backward]
        for rank in range(num_stages)
    }


def _round_sizes(n_units: int, num_ranks: int) -> list[int]:
    """Torch's interleaved rounds, ``max(1, n // p)`` of them, spread evenly.

    torch requires the units to divide into its rounds; rounds that differ by
    one unit give a valid order as well, so no unit count is refused.
    """
    rounds = max(1, n_units // num_ranks)
    size, larger = divmod(n_units, rounds)
    return [size + 1] * larger + [size] * (rounds - larger)


def _by_rounds(
    units: list[Unit], round_sizes: list[int], chunks: list[int]
) -> list[tuple[int, Unit]]:
    """(chunk, unit) in round-robin order: every chunk runs a round's units in turn."""
    order, start = [], 0
    for size in round_sizes:
        order += [(chunk, unit) for chunk in chunks for unit in units[start : start + size]]
        start += size
    return order


def interleaved_seq1f1b_order(
    num_ranks: int, num_chunks: int, n_microbatches: int, num_segments: int
) -> Order:
    """Interleaved Seq1F1B: ``num_chunks`` stages per rank, stage ``c*p + r`` on rank r.

    Every rank runs the same chunk/unit sequences (torch's interleaved rounds
    over units). Forwards take the chunks in turn; backwards take them last to
    first, over units FIFO by microbatch and LIFO by segment. A rank's first
    backward needs its forward done first; torch's warmup
    ``(v-1)*round + 2*(p-1-r)`` is generalised to that need plus ``2*(p-1-r)``,
    which is ``(v-1)*round + (k-1) + 2*(p-1-r)`` when rounds hold whole
    microbatches.
    """
    _check_positive(
        num_ranks=num_ranks,
        num_chunks=num_chunks,
        n_microbatches=n_microbatches,
        num_segments=num_segments,
    )
    units = _forward_units(n_microbatches, num_segments)
    sizes = _round_sizes(len(units), num_ranks)
    forwards = _by_rounds(units, sizes, list(range(num_chunks)))
    backwards = _by_rounds(
        _backward_units(n_microbatches, num_segments), sizes, list(reversed(range(num_chunks)))
    )
    position = {chunk_unit: index for index, chunk_unit in enumerate(forwards)}
    # The b-th backward runs right after forward number warmup + b.
    first_backward_need = max(position[cu] - b for b, cu in enumerate(backwards))
    order: Order = {}
    for rank in range(num_ranks):
        warmup = min(len(forwards), first_backward_need + 2 * (num_ranks - 1 - rank))
        order[rank] = _one_forward_one_backward(
            [SegmentAction(c * num_ranks + rank, "F", *u) for c, u in forwards],
            [SegmentAction(c * num_ranks + rank, "B", *u) for c, u in backwards],
            warmup,
        )
    return order


def seq1f1b_zero_bubble_order(
    num_stages: int, n_microbatches: int, num_segments: int
) -> Order:
    """Seq1F1B with split backwards, ZB-H1 style; one stage per rank.

    Forwards and input gradients (I) follow :func:`seq1f1b_order`. Rank r
    defers its weight gradients (W, in I order) by ``warmup_0 - warmup_r``
    actions (r when nothing is capped): every rank then holds at most rank
    0's ``p + k - 1`` units whose W is outstanding, 1F1B's peak, and the
    deferred W actions fill the cooldown, where later ranks would idle.
    """
    _check_positive(
        num_stages=num_stages, n_microbatches=n_microbatches, num_segments=num_segments
    )
    units = _forward_units(n_microbatches, num_segments)
    backward_units = _backward_units(n_microbatches, num_segments)
    first_warmup = _seq1f1b_warmup(num_stages, 0, len(units), num_segments)
    order: Order = {}
    for rank in range(num_stages):
        warmup = _seq1f1b_warmup(num_stages, rank, len(units), num_segments)
        deferred = first_warmup - warmup
        forwards = iter(units)
        actions = [SegmentAction(rank, "F", *next(forwards)) for _ in range(warmup)]
        weights = iter(backward_units)
        for index, unit in enumerate(backward_units):
            forward = next(forwards, None)
            if forward is not None:
                actions.append(SegmentAction(rank, "F", *forward))
            actions.append(SegmentAction(rank, "I", *unit))
            if index >= deferred:
                actions.append(SegmentAction(rank, "W", *next(weights)))
        actions.extend(SegmentAction(rank, "W", *unit) for unit in weights)
        order[rank] = actions
    return order


def v_stage_to_rank(num_ranks: int) -> Callable[[int], int]:
    """V placement: stage s on rank s for s < p, else on rank 2p-1-s."""
    return lambda stage: stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def seq1f1b_zbv_order(num_ranks: int, n_microbatches: int, num_segments: int) -> Order:
    """Seq1F1B with split backwards on a V: rank r holds stages r and 2p-1-r.

    A unit goes down the ranks on the first chunk and back up on the second,
    so the first and the last stage (the loss) share rank 0. The order comes
    from list scheduling with equal-cost actions (F = I = W): at every step a
    free rank runs the first of these that is ready, each on the later stage
    first so units drain towards the loss:

    1. an input gradient (the ranks before it wait for it);
    2. a forward, while fewer than ``2 * (p + k - 1)`` units (of half a
       stage each) await their W: Seq1F1B's rank-0 activation memory;
    3. a weight gradient, filling what would be a bubble.

    Per stage, forwards run in unit order and I and W in backward unit order,
    so stage 0's W steps (which hold its whole backward) go last segment first.
    """
    _check_positive(
        num_ranks=num_ranks, n_microbatches=n_microbatches, num_segments=num_segments
    )
    num_stages = 2 * num_ranks
    sequences = {
        "F": _forward_units(n_microbatches, num_segments),
        "I": _backward_units(n_microbatches, num_segments),
        "W": _backward_units(n_microbatches, num_segments),
    }
    n_units = len(sequences["F"])
    in_flight_limit = 2 * (num_ranks + num_segments - 1)
    next_index = {(stage, kind): 0 for stage in range(num_stages) for kind in "FIW"}
    finished_at: dict[SegmentAction, int] = {}

    def next_ready(stage: int, kind: str, now: int) -> SegmentAction | None:
        index = next_index[(stage, kind)]
        if index == n_units:
            return None
        action = SegmentAction(stage, kind, *sequences[kind][index])
        needs = {
            "F": [SegmentAction(stage - 1, "F", *action.unit)] if stage > 0 else [],
            "I": [SegmentAction(stage, "F", *action.unit)]
            + ([SegmentAction(stage + 1, "I", *action.unit)] if stage < num_stages - 1 else []),
            "W": [SegmentAction(stage, "I", *action.unit)],
        }[kind]
        done = all(finished_at.get(need, now + 1) <= now for need in needs)
        return action if done else None

    order: Order = {rank: [] for rank in range(num_ranks)}
    awaiting_w = dict.fromkeys(range(num_ranks), 0)
    now = 0
    while len(finished_at) < 3 * n_units * num_stages:
        for rank in range(num_ranks):
            later_first = (num_stages - 1 - rank, rank)
            kinds = "IFW" if awaiting_w[rank] < in_flight_limit else "IW"
            action = next(
                (
                    ready
                    for kind in kinds
                    for stage in later_first
                    if (ready := next_ready(stage, kind, now)) is not None
                ),
                None,
            )
            if action is None:
                continue
            next_index[(action.stage, action.kind)] += 1
            finished_at[action] = now + 1
            awaiting_w[rank] += {"F": 1, "I": 0, "W": -1}[action.kind]
            order[rank].append(action)
        now += 1
    return order


def _check_stage_sequence(
    stage: int, actions: list[SegmentAction], n_microbatches: int, num_segments: int
) -> None:
    """Completeness, forward unit order and LIFO segment backward on one stage."""
    done: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for step, action in enumerate(actions):
        where = f"stage {stage}, step {step} ({action})"
        if action.microbatch >= n_microbatches or action.segment >= num_segments:
            raise ScheduleOrderError(f"{where}: unit out of range")
        if action.unit in done[action.kind]:
            raise ScheduleOrderError(f"{where}: {action.kind} runs twice for this unit")
        i, j = action.unit
        if action.kind in "BI":
            if action.unit not in done["F"]:
                raise ScheduleOrderError(f"{where}: backward before its forward")
            if j + 1 < num_segments and (i, j + 1) not in done["B"] + done["I"]:
                raise ScheduleOrderError(
                    f"{where}: segment {j} backward before segment {j + 1}; "
                    "segments of a microbatch must run backward last to first"
                )
        if action.kind == "W":
            if action.unit not in done["I"]:
                raise ScheduleOrderError(f"{where}: weight gradient before input gradient")
            if j + 1 < num_segments and (i, j + 1) not in done["W"] + done["B"]:
                raise ScheduleOrderError(
                    f"{where}: segment {j} weight gradient before segment {j + 1}"
                )
        done[action.kind].append(action.unit)
    expected = _forward_units(n_microbatches, num_segments)
    if done["F"] != expected:
        raise ScheduleOrderError(
            f"stage {stage}: forwards must run every unit once in (microbatch, "
            f"segment) order; got {[f'{i}.{j}' for i, j in done['F']]}"
        )
    if sorted(done["B"] + done["I"]) != expected or sorted(done["I"]) != sorted(done["W"]):
        raise ScheduleOrderError(
            f"stage {stage}: every unit needs exactly one backward (B, or I then W)"
        )


def _check_progress(order: Order, num_stages: int) -> None:
    """Run the ranks in lockstep on their data dependencies; fail if all wait."""
    position = {rank: 0 for rank in order}
    finished: set[SegmentAction] = set()

    def ready(action: SegmentAction) -> bool:
        if action.kind == "F":
            return action.stage == 0 or (
                SegmentAction(action.stage - 1, "F", *action.unit) in finished
            )
        if action.kind in "BI":
            if action.stage == num_stages - 1:
                return True
            return any(
                SegmentAction(action.stage + 1, kind, *action.unit) in finished
                for kind in "BI"
            )
        return True

    while any(position[r] < len(order[r]) for r in order):
        runnable = [
            rank
            for rank in order
            if position[rank] < len(order[rank]) and ready(order[rank][position[rank]])
        ]
        if not runnable:
            waiting = [str(order[r][position[r]]) for r in order if position[r] < len(order[r])]
            raise ScheduleOrderError(f"deadlock: every rank waits; next actions {waiting}")
        for rank in runnable:
            finished.add(order[rank][position[rank]])
            position[rank] += 1


def lower_order(order: Order, num_segments: int) -> dict[int, list]:
    """Torch runtime actions (virtual microbatches) for a segment order."""
    return {rank: [a.lower(num_segments) for a in acts] for rank, acts in order.items()}


def _check_channels_fifo(with_comms: dict[int, list], stage_to_rank: Callable[[int], int]) -> None:
    """Every rank pair must post receives in the order the peer sends.

    Point-to-point messages from one rank to another match in posting order,
    whatever they carry (torch sends activations and gradients untagged); a
    receive posted out of order would take another unit's bytes, and an
    activation and a gradient of the same shape would swap silently.
    """
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank, actions in with_comms.items():
        for a in actions:
            kind = a.computation_type.value
            if kind in ("SEND_F", "SEND_B"):
                peer = a.stage_index + (1 if kind == "SEND_F" else -1)
                message = (kind[-1], a.stage_index, a.microbatch_index)
                sends[(rank, stage_to_rank(peer))].append(message)
            elif kind in ("RECV_F", "RECV_B"):
                peer = a.stage_index + (-1 if kind == "RECV_F" else 1)
                message = (kind[-1], peer, a.microbatch_index)
                recvs[(stage_to_rank(peer), rank)].append(message)
    for channel in set(sends) | set(recvs):
        if sends[channel] != recvs[channel]:
            src, dst = channel
            raise ScheduleOrderError(
                f"rank {dst} posts receives from rank {src} in the order "
                f"{recvs[channel]} but rank {src} sends {sends[channel]} "
                "(direction, sending stage, virtual microbatch)"
            )


def validate_order(
    order: Order,
    num_stages: int,
    n_microbatches: int,
    num_segments: int,
    stage_to_rank: Callable[[int], int] | None = None,
) -> None:
    """Raise ScheduleOrderError unless ``order`` is a valid segmented schedule.

    Checks, per stage: every unit's forward once and in unit order; one
    backward per unit (B, or I then W) after its forward, last segment first;
    and across ranks: no deadlock on data dependencies, and no deadlock or
    out-of-order message after torch inserts its sends and receives.
    """
    stage_to_rank = stage_to_rank or (lambda stage: stage)
    by_stage: dict[int, list[SegmentAction]] = defaultdict(list)
    for rank, actions in order.items():
        for action in actions:
            if not 0 <= action.stage < num_stages or stage_to_rank(action.stage) != rank:
                raise ScheduleOrderError(f"rank {rank} runs {action} of another rank's stage")
            by_stage[action.stage].append(action)
    for stage in range(num_stages):
        _check_stage_sequence(stage, by_stage[stage], n_microbatches, num_segments)
    _check_progress(order, num_stages)
    try:
        with_comms = _add_send_recv(
            lower_order(order, num_segments), stage_to_rank, num_stages
        )
        _simulate_comms_compute(
            {rank: list(actions) for rank, actions in with_comms.items()},
            stage_to_rank,
            num_stages,
        )
    except (AssertionError, ValueError) as error:
        raise ScheduleOrderError(f"torch's send/recv lowering rejects the order: {error}") from error
    _check_channels_fifo(with_comms, stage_to_rank)

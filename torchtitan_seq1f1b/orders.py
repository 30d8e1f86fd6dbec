# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B per-rank compute orders and the checker every order must pass.

Notation: p stages (one per rank), m microbatches, k segments, rank r.
Forwards run in unit order (0,0), (0,1), ..., (m-1,k-1). Backwards are FIFO
over microbatches and LIFO over segments, since segment j's K/V gradients
come from segments j+1..k-1. Rank r runs ``min(m*k, (p-r-1) + (k-1))``
warmup forwards, then one-forward-one-backward pairs, then the remaining
backwards. With k = 1 this is exactly torch's 1F1B order.
"""

from collections import defaultdict
from collections.abc import Callable

from torchtitan_seq1f1b._torch_compat import _add_send_recv, _simulate_comms_compute
from torchtitan_seq1f1b.actions import SegmentAction

__all__ = [
    "ScheduleOrderError",
    "lower_order",
    "seq1f1b_order",
    "validate_order",
]

Order = dict[int, list[SegmentAction]]


class ScheduleOrderError(ValueError):
    """A compute order that is incomplete, misordered or would deadlock."""


def _backward_units(n_microbatches: int, num_segments: int) -> list[tuple[int, int]]:
    return [
        (i, j)
        for i in range(n_microbatches)
        for j in reversed(range(num_segments))
    ]


def seq1f1b_order(num_stages: int, n_microbatches: int, num_segments: int) -> Order:
    """The Seq1F1B order of every rank, one stage per rank."""
    for name, value in (
        ("num_stages", num_stages),
        ("n_microbatches", n_microbatches),
        ("num_segments", num_segments),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    units = [(i, j) for i in range(n_microbatches) for j in range(num_segments)]
    backward_units = _backward_units(n_microbatches, num_segments)
    order: Order = {}
    for rank in range(num_stages):
        warmup = min(len(units), (num_stages - rank - 1) + (num_segments - 1))
        actions = [SegmentAction(rank, "F", *u) for u in units[:warmup]]
        backwards = iter(backward_units)
        for unit in units[warmup:]:
            actions.append(SegmentAction(rank, "F", *unit))
            actions.append(SegmentAction(rank, "B", *next(backwards)))
        actions.extend(SegmentAction(rank, "B", *unit) for unit in backwards)
        order[rank] = actions
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
    expected = [(i, j) for i in range(n_microbatches) for j in range(num_segments)]
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

    Point-to-point messages between two ranks match in posting order; a
    receive posted out of order would take another segment's bytes.
    """
    sends: dict[tuple[int, int, str], list] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list] = defaultdict(list)
    for rank, actions in with_comms.items():
        for a in actions:
            kind = a.computation_type.value
            if kind in ("SEND_F", "SEND_B"):
                peer = a.stage_index + (1 if kind == "SEND_F" else -1)
                sends[(rank, stage_to_rank(peer), kind[-1])].append((a.stage_index, a.microbatch_index))
            elif kind in ("RECV_F", "RECV_B"):
                peer = a.stage_index + (-1 if kind == "RECV_F" else 1)
                sender_stage = peer
                recvs[(stage_to_rank(peer), rank, kind[-1])].append((sender_stage, a.microbatch_index))
    for channel in set(sends) | set(recvs):
        if sends[channel] != recvs[channel]:
            src, dst, direction = channel
            raise ScheduleOrderError(
                f"rank {dst} posts {direction}-direction receives from rank {src} in "
                f"the order {recvs[channel]} but rank {src} sends {sends[channel]}"
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

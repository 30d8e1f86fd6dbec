# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The checker every order must pass before a schedule runs it."""

from collections import defaultdict
from collections.abc import Callable

from torchtitan_seq1f1b._torch_compat import _add_send_recv, _simulate_comms_compute
from torchtitan_seq1f1b.actions import Order, SegmentAction, Unit
from torchtitan_seq1f1b.orders.units import forward_units

__all__ = ["ScheduleOrderError", "lower_order", "validate_order"]


class ScheduleOrderError(ValueError):
    """A compute order that is incomplete, misordered or would deadlock."""


def _any_has(unit: tuple[int, int], *sets: set[Unit]) -> bool:
    return any(unit in units for units in sets)


def _check_stage_sequence(
    stage: int, actions: list[SegmentAction], n_microbatches: int, num_segments: int
) -> None:
    """Completeness, forward unit order and LIFO segment backward on one stage."""
    done: dict[str, list[Unit]] = defaultdict(list)
    # Sets beside the lists: an order validates in time linear in its actions.
    seen: dict[str, set[Unit]] = defaultdict(set)
    for step, action in enumerate(actions):
        kind, unit = action.kind, action.unit
        i, j = unit
        error = None
        if i >= n_microbatches or j >= num_segments:
            error = "unit out of range"
        elif unit in seen[kind]:
            error = f"{kind} runs twice for this unit"
        elif kind in "BI":
            if unit not in seen["F"]:
                error = "backward before its forward"
            elif j + 1 < num_segments and not _any_has((i, j + 1), seen["B"], seen["I"]):
                error = (
                    f"segment {j} backward before segment {j + 1}; "
                    "segments of a microbatch must run backward last to first"
                )
        elif kind == "W":
            if unit not in seen["I"]:
                error = "weight gradient before input gradient"
            elif j + 1 < num_segments and not _any_has((i, j + 1), seen["W"], seen["B"]):
                error = f"segment {j} weight gradient before segment {j + 1}"
        if error is not None:
            raise ScheduleOrderError(f"stage {stage}, step {step} ({action}): {error}")
        done[kind].append(unit)
        seen[kind].add(unit)
    expected = forward_units(n_microbatches, num_segments)
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
    # (stage, kind, microbatch, segment) of every action run so far.
    finished: set[tuple[int, str, int, int]] = set()

    def ready(action: SegmentAction) -> bool:
        stage, i, j = action.stage, action.microbatch, action.segment
        if action.kind == "F":
            return stage == 0 or (stage - 1, "F", i, j) in finished
        if action.kind in "BI":
            return (
                stage == num_stages - 1
                or (stage + 1, "B", i, j) in finished
                or (stage + 1, "I", i, j) in finished
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
            action = order[rank][position[rank]]
            finished.add((action.stage, action.kind, action.microbatch, action.segment))
            position[rank] += 1


def lower_order(order: Order, num_segments: int) -> dict[int, list]:
    """Torch runtime actions (one per unit chunk id) for a segment order."""
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
                "(direction, sending stage, chunk id)"
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

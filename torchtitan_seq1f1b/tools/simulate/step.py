# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One simulated step: the timeline of the schedule's real order, and every rank's memory peaks."""

from dataclasses import asdict, dataclass
from itertools import accumulate

from torchtitan_seq1f1b.orders import equal_cost_bubble, replay
from torchtitan_seq1f1b.actions import SegmentAction
from torchtitan_seq1f1b.planner import RuntimeOverhead
from torchtitan_seq1f1b.tools.simulate.config import schedule_order, SimConfig
from torchtitan_seq1f1b.tools.simulate.memory import rank_memory
from torchtitan_seq1f1b.tools.simulate.unit_times import action_duration

__all__ = [
    "activation_peaks","RankReport", "SimResult", "simulate"]


@dataclass(frozen=True)
class RankReport:
    """Per-rank results; byte counts are peaks over the step.

    ``busy`` and ``idle`` are in forwards of one microbatch on one rank.
    ``peak_activation_microbatches`` is the activation peak in units of one
    unsplit microbatch's activations over all of the rank's stages (the ``A``
    of the design note's theory table).
    """

    rank: int
    stages: tuple[int, ...]
    busy: float
    idle: float
    model_state_bytes: int
    peak_activation_bytes: int
    peak_kv_bytes: int
    peak_memory_bytes: int
    peak_activation_microbatches: float


@dataclass(frozen=True)
class SimResult:
    """Everything one simulation reports.

    ``analytic_bubble_fraction`` is None where no closed form is exact (see
    ``SCHEDULE_SPECS``).
    """

    config: SimConfig
    segment_lengths: tuple[int, ...]
    makespan: float
    bubble_fraction: float
    equal_cost_bubble_fraction: float
    analytic_bubble_fraction: float | None
    ranks: tuple[RankReport, ...]

    @property
    def schedule(self) -> str:
        return self.config.schedule

    @property
    def segment_flops_imbalance(self) -> float:
        """Largest segment's forward FLOPs over the mean, under the simulated attention."""
        flops = [
            self.config.segment_cost.forward_flops(n, end)
            for n, end in zip(self.segment_lengths, accumulate(self.segment_lengths))
        ]
        return max(flops) * len(flops) / sum(flops)

    @property
    def peak_memory_bytes(self) -> list[int]:
        return [r.peak_memory_bytes for r in self.ranks]

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes)

    def to_record(self) -> dict:
        """The JSON record the CLI's ``--json`` writes."""
        cfg = self.config
        record = {
            "schedule": self.schedule,
            "chunks": cfg.v,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "equal_cost_bubble_fraction": self.equal_cost_bubble_fraction,
            "analytic_bubble_fraction": self.analytic_bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "config": {
                "model": {"name": cfg.model_name, **asdict(cfg.model)},
                "seq_len": cfg.seq_len,
                "pp": cfg.pp,
                "tp": cfg.tp,
                "dp": cfg.dp,
                "cp": cfg.cp,
                "v": cfg.v,
                "microbatches": cfg.microbatches,
                "segments": cfg.num_segments,
                "partition": cfg.partition,
                "p2p_latency": cfg.p2p_latency,
                "backward_split": cfg.backward_split,
                "memory": asdict(cfg.memory),
            },
            "segment_lengths": list(self.segment_lengths),
            "ranks": [asdict(r) for r in self.ranks],
        }
        if cfg.cp > 1:
            record["config"].update(
                cp_bytes_per_second=cfg.cp_bytes_per_second, cp_latency=cfg.cp_latency,
                device_flops=cfg.device_flops,
            )
        if cfg.documents is not None:
            record["config"]["documents"] = {
                "name": cfg.documents_name, "mean": cfg.documents.mean,
            }
            record["segment_flops_imbalance"] = self.segment_flops_imbalance
        return record


def simulate(config: SimConfig) -> SimResult:
    """Simulate one step of ``config.schedule``: timeline and per-rank memory."""
    plan = config.plan()
    k, v = plan.num_segments, config.v
    order = schedule_order(config)
    unit_duration = action_duration(config, plan)
    runtime = config.time_model.runtime if config.time_model else RuntimeOverhead()

    def duration(action: SegmentAction) -> float:
        # Hand-offs carry a rank's share of the segment, L / cp tokens.
        return unit_duration(action) + runtime.action_seconds(
            plan.lengths[action.segment] // config.cp
        )

    timeline = replay(order, duration, config.p2p_latency)
    per_step = runtime.per_step
    ranks = []
    for rank, actions in order.items():
        memory = rank_memory(config, plan, actions)
        busy = timeline.busy[rank] + per_step
        ranks.append(
            RankReport(
                rank=rank,
                stages=tuple(sorted({a.stage for a in actions})),
                busy=busy,
                idle=timeline.makespan + per_step - busy,
                model_state_bytes=int(memory.model_state_bytes),
                peak_activation_bytes=int(memory.peak_activation_bytes),
                peak_kv_bytes=int(memory.peak_kv_bytes),
                peak_memory_bytes=int(memory.peak_memory_bytes),
                peak_activation_microbatches=memory.peak_activation_microbatches,
            )
        )
    return SimResult(
        config=config,
        segment_lengths=plan.lengths,
        makespan=timeline.makespan + per_step,
        bubble_fraction=timeline.bubble_fraction,
        equal_cost_bubble_fraction=equal_cost_bubble(order, k, v),
        analytic_bubble_fraction=config.spec.analytic(config.pp, v, config.microbatches, k),
        ranks=tuple(ranks),
    )


def activation_peaks(result: SimResult) -> list[int]:
    """Simulated activation + K/V peak per rank in bytes (model states left out)."""
    return [r.peak_memory_bytes - r.model_state_bytes for r in result.ranks]

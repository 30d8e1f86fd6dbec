# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What one simulated step is: the model, layout and schedule, and the memory model's knobs."""

from dataclasses import dataclass, field
from functools import cached_property

from torchtitan_seq1f1b.actions import Order
from torchtitan_seq1f1b.context_parallel import check_context_parallel, context_parallel_align
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig
from torchtitan_seq1f1b.planner import (
    ContextParallelCost,
    even_stage_blocks,
    segment_plan,
    TimeModel,
)
from torchtitan_seq1f1b.segmenting import (
    DocumentLengths,
    PackedDocumentsCost,
    SegmentPlan,
    TransformerCost,
)
from torchtitan_seq1f1b.tools.simulate.schedules import SCHEDULE_SPECS, SCHEDULES, ScheduleSpec

__all__ = [
    "runtime_memory_model",
    "PARTITIONS",
    "MemoryModel",
    "SimConfig",
    "schedule_order",
]

PARTITIONS = ("uniform", "causal-balanced", "balanced", "time")


@dataclass(frozen=True)
class MemoryModel:
    """Knobs of the memory model (docs/simulator.md, "Memory model").

    Args:
        sequence_parallel: activations that TP cannot split are sharded along
            the sequence too (Megatron ``--sequence-parallel``).
        attention: "flash" (no score matrix stored) or "eager" (scores,
            softmax and dropout of size ``segment x attended`` per head stored).
        dropout: dropout masks are stored (Korthikanti's 34 assumes so).
        kv_store: "preallocated" (this repo) or "prefix" (the paper's code).
        distributed_optimizer: Adam states and fp32 master weights split by dp.
        micro_batch_size: sequences per microbatch (``b``).
    """

    sequence_parallel: bool = True
    attention: str = "flash"
    dropout: bool = True
    kv_store: str = "preallocated"
    distributed_optimizer: bool = False
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "eager"):
            raise ValueError(f"attention={self.attention!r} must be 'flash' or 'eager'")
        if self.kv_store not in ("preallocated", "prefix"):
            raise ValueError(f"kv_store={self.kv_store!r} must be 'preallocated' or 'prefix'")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1")


@dataclass(frozen=True)
class SimConfig:
    """One simulated training step.

    ``segments`` only applies to the segmented schedules (Seq1F1B,
    InterleavedSeq1F1B, Seq1F1BZeroBubble); torch's schedules run whole
    microbatches (k = 1). ``v`` is the number of stages (model chunks) per
    rank; ``None`` means the schedule's default (1, or 2 for the multi-stage
    schedules). ``backward_split`` sets the I/W costs of split backwards:
    "equal" (I = W = F) or "flops" (W = weight-gradient FLOPs).
    ``p2p_latency`` is in forwards of one microbatch on one rank.
    ``time_model``: calibrated unit times (:mod:`torchtitan_seq1f1b.planner`);
    with it, actions take their measured seconds (the head on the last stage),
    ``p2p_latency`` is in seconds, and the "time" partition is available.
    ``cp``: context parallel degree c of every schedule (segment lengths, and
    ``seq_len``, multiples of 2c): a rank computes and keeps 1/c of every unit
    and all-gathers (forward) and reduce-scatters (backward) K/V per layer at
    ``cp_bytes_per_second`` plus ``cp_latency`` seconds per collective
    (:class:`~torchtitan_seq1f1b.planner.ContextParallelCost`); without a time
    model ``device_flops``, the FLOP/s one rank achieves, converts those seconds
    into forwards.
    ``linear_attention``: the shape of the model's ``model.linear_layers``
    GatedDeltaNet layers, whose carried state replaces their K/V store
    (default :meth:`GatedDeltaNetConfig.like_attention`).
    """

    model: TransformerCost
    seq_len: int
    pp: int
    microbatches: int
    segments: int = 4
    schedule: str = "Seq1F1B"
    tp: int = 1
    dp: int = 1
    v: int | None = None
    partition: str = "balanced"
    p2p_latency: float = 0.0
    align: int | None = None
    backward_split: str = "equal"
    memory: MemoryModel = field(default_factory=MemoryModel)
    model_name: str = "custom"
    documents: DocumentLengths | None = None
    documents_name: str = "custom"
    time_model: TimeModel | None = None
    cp: int = 1
    cp_bytes_per_second: float = ContextParallelCost.bytes_per_second
    cp_latency: float = ContextParallelCost.latency
    device_flops: float = 400e12
    linear_attention: GatedDeltaNetConfig | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_SPECS:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.v is None:
            object.__setattr__(self, "v", self.spec.min_chunks)
        if self.linear_attention is None:
            object.__setattr__(self, "linear_attention", GatedDeltaNetConfig.like_attention(self.model))
        for name in ("seq_len", "pp", "microbatches", "segments", "tp", "dp", "v", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        problem = self.spec.chunks_problem(self.schedule, self.v)
        if problem:
            raise ValueError(f"v={self.v} stages per rank: {problem}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r} must be one of {PARTITIONS}")
        if self.partition == "time" and self.time_model is None:
            raise ValueError(
                'partition="time" balances calibrated unit times: give a time_model '
                "(python -m torchtitan_seq1f1b.plan and the bench calibrate one)"
            )
        if self.backward_split not in ("equal", "flops"):
            raise ValueError(
                f"backward_split={self.backward_split!r} must be 'equal' or 'flops'"
            )
        if self.p2p_latency < 0:
            raise ValueError(f"p2p_latency={self.p2p_latency} must be >= 0")
        if self.num_stages > self.model.n_layers:
            raise ValueError(
                f"pp={self.pp} x v={self.v} = {self.num_stages} stages exceeds the model's "
                f"{self.model.n_layers} layers; every stage needs at least one block: "
                "lower pp or v (CLI: --pp, --chunks/-v)"
            )
        if self.model.n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide n_heads={self.model.n_heads}; "
                "tensor parallelism splits attention heads"
            )
        if not self.device_flops > 0:
            raise ValueError(f"device_flops={self.device_flops} must be > 0")
        try:
            self.cp_cost  # noqa: B018 - checks the bandwidth and latency
            if self.cp > 1:  # without CP, plan() names a misaligned seq_len
                check_context_parallel(self.seq_len, self._align_without_cp, self.cp)
        except ValueError as error:
            raise ValueError(f"cp={self.cp} (CLI: --cp, --seq-len): {error}") from None

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULE_SPECS[self.schedule]

    @property
    def num_stages(self) -> int:
        """Pipeline stages: pp ranks x v stages per rank."""
        return self.pp * self.v

    @property
    def num_segments(self) -> int:
        """k actually used: 1 unless the schedule is segmented."""
        return self.segments if self.spec.segmented else 1

    @property
    def _align_without_cp(self) -> int:
        if self.align is not None:
            return self.align
        return self.tp if self.memory.sequence_parallel else 1

    @property
    def segment_align(self) -> int:
        """Segments are multiples of tp under sequence parallel (each TP rank gets s/tp), and
        of 2 * cp under context parallelism (each CP rank gets two of 2 * cp pieces)."""
        return context_parallel_align(self._align_without_cp, self.cp)

    @property
    def cp_cost(self) -> ContextParallelCost:
        return ContextParallelCost(self.cp, self.cp_bytes_per_second, self.cp_latency)

    @cached_property
    def segment_cost(self) -> TransformerCost | PackedDocumentsCost:
        """Forward FLOPs per segment: causal, or document-masked under ``documents``."""
        if self.documents is None:
            return self.model
        return PackedDocumentsCost.expected(self.model, self.documents, self.seq_len)

    def plan(self) -> SegmentPlan:
        k = self.num_segments
        if self.partition == "uniform" or k == 1:
            return SegmentPlan.uniform(self.seq_len, k, self.segment_align)
        if self.partition == "time":
            return segment_plan(
                "time", self.seq_len, k, self.model, self.time_model, self.model.n_layers,
                self.segment_align,
            )
        cost = self.model if self.partition == "causal-balanced" else self.segment_cost
        return SegmentPlan.balanced(self.seq_len, k, cost, self.segment_align)

    def layers_per_stage(self) -> list[int]:
        """Blocks per stage; a remainder goes to the earliest stages."""
        return list(even_stage_blocks(self.model.n_layers, self.num_stages))


def schedule_order(config: SimConfig) -> Order:
    """The per-rank compute order the real schedule named ``config.schedule`` runs."""
    return config.spec.order(config.pp, config.v, config.microbatches, config.num_segments)


def runtime_memory_model(microbatch_size: int = 1) -> MemoryModel:
    """The memory model of this package's runtime on the benchmark model.

    No TP, no dropout, a flash kernel (no score matrix saved), the
    preallocated K/V store. Activations are counted in bf16 with Korthikanti's
    per-token constants: compare ratios, not bytes, with fp32 measurements.
    """
    return MemoryModel(
        sequence_parallel=False,
        attention="flash",
        dropout=False,
        kv_store="preallocated",
        micro_batch_size=microbatch_size,
    )

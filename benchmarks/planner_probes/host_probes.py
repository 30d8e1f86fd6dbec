# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The planner's :class:`HostProbes` for pipeline ranks sharing this host's CPU cores."""

from __future__ import annotations

from benchmarks.planner_probes.pipeline_units import measure_pipeline_units
from benchmarks.planner_probes.runtime_overhead import measure_runtime_overhead
from torchtitan_seq1f1b.planner.calibrate import CalibrationTarget, HostProbes, UnitFits
from torchtitan_seq1f1b.planner.time_model import fit_unit_time, KINDS, RuntimeOverhead

__all__ = ["CPU_HOST_PROBES", "pipeline_unit_fits", "runtime_overhead"]


def runtime_overhead(target: CalibrationTarget) -> RuntimeOverhead:
    """The runtime's own cost per action on the host: where units are timed inside pipeline
    steps, only what it spends outside their calls."""
    return measure_runtime_overhead(
        target.seq_len,
        target.shape.dim,
        target.microbatch_size,
        target.dtype,
        outside_calls=target.contenders > 1,
    )


def pipeline_unit_fits(target: CalibrationTarget) -> UnitFits:
    """A block's and the head's unit times from units timed inside pipeline steps
    (:mod:`.pipeline_units`) on ``target.contenders`` local ranks."""
    count = target.chained_blocks
    times = measure_pipeline_units(
        target.shape,
        target.seq_len,
        ranks=target.contenders,
        chained_blocks=count,
        microbatch_size=target.microbatch_size,
        dtype=target.dtype,
        attention_backend=target.attention_backend,
    )
    # Residuals relative to the plan's time rather than the unit's: a step's error is its units'
    # errors in seconds, which relative errors would let many short units outweigh.
    block = {
        kind: fit_unit_time(
            [(n, end, t) for n, end, t, _ in times.block[kind]],
            scale=[plan for *_, plan in times.block[kind]],
        )
        for kind in KINDS
    }
    # The head is what the last stage takes beyond its blocks, relative to the stage's plan.
    head = {
        kind: fit_unit_time(
            [(n, end, t - count * block[kind](n, end)) for n, end, t, _ in times.last_stage[kind]],
            with_pairs=False,
            scale=[plan for *_, plan in times.last_stage[kind]],
        )
        for kind in KINDS
    }
    return block, head


CPU_HOST_PROBES = HostProbes(unit_fits=pipeline_unit_fits, runtime_overhead=runtime_overhead)

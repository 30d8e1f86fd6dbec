# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The calibrated planner: how long units take on this device, and which k and lengths to run.

- :mod:`.calibrate`: time a chain of blocks (as many as a rank holds) and the
  head of the job's shape, segment by segment, on its device and dtype; fit
  and cache a :class:`TimeModel`;
- :mod:`.time_model`: the fitted unit times, per-token bytes and runtime cost,
  and what context parallelism adds to them;
- :mod:`.estimate`: one plan's predicted step time, bubble and per-rank
  memory under a schedule's real order;
- :mod:`.choose`: segment plans per partition ("time" equalises calibrated
  time) and the fastest plan within a memory budget;
- :mod:`.auto`: a job's request, calibrated and chosen in one call.

``python -m torchtitan_seq1f1b.plan`` prints the recommendation; the adapters
call it for ``num_segments = "auto"``.
"""

from torchtitan_seq1f1b.planner.auto import (
    AutoPlan,
    AutoPlanRequest,
    plan_automatically,
    recommend_for,
)
from torchtitan_seq1f1b.planner.calibrate import (
    CACHE_ENV,
    cached_calibration,
    calibrate,
    CalibrationTarget,
    HostProbes,
    MAX_CHAINED_BLOCKS,
    rank_chain_length,
)
from torchtitan_seq1f1b.planner.choose import (
    GIB,
    NoPlanFitsError,
    PARTITIONS,
    PredictedTime,
    Recommendation,
    recommend,
    segment_plan,
)
from torchtitan_seq1f1b.planner.estimate import (
    estimate,
    even_stage_blocks,
    PipelineShape,
    PlanEstimate,
)
from torchtitan_seq1f1b.planner.llama_block import LlamaBlock
from torchtitan_seq1f1b.planner.time_model import (
    causal_pairs,
    ContextParallelCost,
    fit_unit_time,
    prefix_rectangle,
    RuntimeOverhead,
    TimeModel,
    UnitTime,
)

__all__ = [
    "AutoPlan",
    "AutoPlanRequest",
    "CACHE_ENV",
    "ContextParallelCost",
    "GIB",
    "LlamaBlock",
    "MAX_CHAINED_BLOCKS",
    "NoPlanFitsError",
    "PARTITIONS",
    "PipelineShape",
    "PlanEstimate",
    "PredictedTime",
    "Recommendation",
    "RuntimeOverhead",
    "CalibrationTarget",
    "HostProbes",
    "TimeModel",
    "UnitTime",
    "cached_calibration",
    "calibrate",
    "causal_pairs",
    "estimate",
    "even_stage_blocks",
    "fit_unit_time",
    "plan_automatically",
    "prefix_rectangle",
    "rank_chain_length",
    "recommend",
    "recommend_for",
    "segment_plan",
]

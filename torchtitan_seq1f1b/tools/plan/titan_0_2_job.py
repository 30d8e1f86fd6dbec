# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan 0.2.2 job config read as its job would lay it out, without starting it.

The plan command (``python -m torchtitan_seq1f1b.plan --job-config``) needs
what a Seq1F1B job would hand the planner: the model's dims, the stages per
rank, the microbatches and the compute dtype. They come from torchtitan's own
config parsing and train spec, and the job's start-up checks run first, so a
config the job would reject is rejected here with the same message.
"""

import math
from pathlib import Path

import torch

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_seq1f1b.tools.plan.job_layout import JobLayout, parallel_degrees
from torchtitan_seq1f1b.integration.segment_plan import plan_align, Seq1F1BConfigError
from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.integration.titan_0_2.pipeline import (
    attention_target,
    check_job,
    module_names_per_stage,
    transformer_cost,
)

__all__ = ["read_job_layout"]


def read_job_layout(
    config_file: str | Path, overrides: list[str], device: torch.device
) -> JobLayout:
    """Parse ``config_file`` with torchtitan's ``overrides`` (``--section.key value``)
    and check it as a job on ``device`` would.

    ``data_parallel_shard_degree = -1`` takes no ranks here (no world size is
    known), so the dtype is float32 unless the degree is set above 1. Raises
    :class:`Seq1F1BConfigError` for what the job would refuse, including a
    schedule that is not one of Seq1F1B's.
    """
    if not Path(config_file).is_file():
        raise Seq1F1BConfigError(f"job config {str(config_file)!r} is not a file")
    job_config = ConfigManager().parse_args(["--job.config_file", str(config_file), *overrides])
    parallelism = job_config.parallelism
    name = parallelism.pipeline_parallel_schedule
    entry = SCHEDULES.get(name)
    if entry is None:
        raise Seq1F1BConfigError(
            f"parallelism.pipeline_parallel_schedule={name!r} is not a Seq1F1B schedule; "
            f"set it to one of {sorted(SCHEDULES)} (or pass --schedule)"
        )
    spec = get_train_spec(job_config.model.name)
    try:
        model_args = spec.model_args[job_config.model.flavor]
    except KeyError:
        raise Seq1F1BConfigError(
            f"model.flavor={job_config.model.flavor!r} is not a {job_config.model.name} "
            f"flavor; choose one of {sorted(spec.model_args)}"
        ) from None
    model_args.update_from_config(job_config)
    degrees = parallel_degrees(parallelism)
    parallel_dims = ParallelDims(**degrees, ep=1, etp=1, world_size=math.prod(degrees.values()))
    check_job(job_config, parallel_dims, model_args, device)
    stages = module_names_per_stage(job_config, parallel_dims, model_args, entry)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    options = job_config.seq1f1b
    return JobLayout(
        shape=transformer_cost(model),
        seq_len=job_config.training.seq_len,
        num_ranks=parallel_dims.pp,
        schedule=name,
        stages_per_rank=len(stages) // parallel_dims.pp,
        microbatches=job_config.training.local_batch_size
        // parallelism.pipeline_parallel_microbatch_size,
        microbatch_size=parallelism.pipeline_parallel_microbatch_size,
        align=plan_align(
            options, job_config.training.seq_len, parallel_dims.tp, parallel_dims.cp,
            device.type == "cuda",
        ),
        attention_backend=options.attention_backend,
        memory_budget_gib=options.memory_budget_gib,
        dtype=attention_target(job_config, parallel_dims, model_args, device).dtype,
        context_parallel=parallel_dims.cp,
    )

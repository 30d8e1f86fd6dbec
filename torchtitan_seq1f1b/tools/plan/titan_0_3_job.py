# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan 0.3 (or main) job config read as its job would lay it out, without starting it.

torchtitan 0.3 configs are Python: a function of a module's config registry,
named the way ``torchtitan.train`` takes them (``--module torchtitan_seq1f1b
--config seq1f1b_debug``). torchtitan's ``ConfigManager`` builds it with the
command's overrides, and the job's start-up checks run on it, so a config the
job would refuse is refused here with the same message.
"""

import math

import torch

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata

from torchtitan_seq1f1b.integration.segment_plan import plan_align, Seq1F1BConfigError
from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.integration.titan_0_3.config_checks import (
    check_attention_backend,
    check_config,
    compute_dtype,
    runs_seq1f1b,
)
from torchtitan_seq1f1b.integration.titan_0_3.release import (
    microbatch_rows,
    num_microbatches,
    sequence_length,
)
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import attention_head_dim, transformer_cost
from torchtitan_seq1f1b.tools.plan.job_layout import JobLayout, parallel_degrees

__all__ = ["read_job_layout"]


def _build(module: str, config_name: str, overrides: list[str]):
    try:
        return ConfigManager().parse_args(["--module", module, "--config", config_name, *overrides])
    except (ImportError, ValueError, TypeError) as error:
        raise Seq1F1BConfigError(str(error)) from None
    except SystemExit:  # torchtitan's parser printed why
        raise Seq1F1BConfigError(
            f"torchtitan could not apply {' '.join(overrides)} to {config_name} (see above)"
        ) from None


def read_job_layout(
    module: str, config_name: str, overrides: list[str], device: torch.device
) -> JobLayout:
    """Build ``module``'s config ``config_name`` with ``overrides`` (``--section.key=value``)
    and check it as a job on ``device`` would.

    ``data_parallel_shard_degree = -1`` takes no ranks here (no world size is
    known), so the dtype is ``training.dtype`` unless the degree is set above 1.
    Raises :class:`Seq1F1BConfigError` for what the job would refuse, and for a
    job that would not run a Seq1F1B schedule.
    """
    config = _build(module, config_name, [])
    if not hasattr(config, "seq1f1b") or config.model_spec is None:
        raise Seq1F1BConfigError(
            f"{module} config {config_name!r} is not a Seq1F1B job (no seq1f1b section or no "
            "model); build it as Seq1F1BTrainer.Config with a model_spec, like "
            "torchtitan_seq1f1b's seq1f1b_debug"
        )
    if overrides:
        config = _build(module, config_name, overrides)
    parallelism = config.parallelism
    if not runs_seq1f1b(config):
        raise Seq1F1BConfigError(
            f"the job runs no Seq1F1B schedule (parallelism.pipeline_parallel_degree="
            f"{parallelism.pipeline_parallel_degree}, seq1f1b.schedule={config.seq1f1b.schedule!r}); "
            f"set the degree above 1 and seq1f1b.schedule to one of {sorted(SCHEDULES)} "
            "(or pass --pp and --schedule)"
        )
    check_config(config)
    options, training = config.seq1f1b, config.training
    model_config = config.model_spec.model
    degrees = parallel_degrees(parallelism)
    parallel_dims = ParallelDims(**degrees, ep=1, world_size=math.prod(degrees.values()))
    check_attention_backend(
        options, training, parallel_dims, attention_head_dim(model_config), device
    )
    try:
        num_stages, *_ = _get_pipeline_metadata(parallel_dims, parallelism, model_config)
    except ValueError as error:
        raise Seq1F1BConfigError(str(error)) from None
    seq_len = sequence_length(training)
    return JobLayout(
        shape=transformer_cost(model_config),
        seq_len=seq_len,
        num_ranks=parallel_dims.pp,
        schedule=options.schedule,
        stages_per_rank=num_stages // parallel_dims.pp,
        microbatches=num_microbatches(training, parallelism),
        microbatch_size=microbatch_rows(parallelism),
        align=plan_align(
            options, seq_len, parallel_dims.tp, parallel_dims.cp, device.type == "cuda"
        ),
        attention_backend=options.attention_backend,
        memory_budget_gib=options.memory_budget_gib,
        dtype=compute_dtype(training, parallel_dims),
        context_parallel=parallel_dims.cp,
    )

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Config checks of a torchtitan 0.3 Seq1F1B job, before the trainer starts anything.

They read the config alone, so every rank raises the same
:class:`~torchtitan_seq1f1b.integration.segment_plan.Seq1F1BConfigError`, naming the
options, before the first collective. The attention kernel, which depends on
the device and the parameter dtype, is checked by the pipelining function
(:func:`check_attention_backend`), still before any pipeline message.
"""


import torch

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import TORCH_DTYPE_MAP, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.tools import utils
from torchtitan.trainer import Trainer

from torchtitan_seq1f1b.attention import check_backend, KernelTarget
from torchtitan_seq1f1b.integration.config_problems import shared_problems
from torchtitan_seq1f1b.integration.context_parallel import context_parallel_problems
from torchtitan_seq1f1b.integration.segment_plan import (
    plan_align,
    planner_problems,
    Seq1F1BConfigError,
    uses_planner,
)
from torchtitan_seq1f1b.integration.schedules import SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from torchtitan_seq1f1b.integration.titan_0_3.gated_delta_net import gated_delta_net_problems
from torchtitan_seq1f1b.integration.titan_0_3.job_data import data_problems
from torchtitan_seq1f1b.integration.titan_0_3.options import NO_SCHEDULE, Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.release import sequence_length
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import segment_plan_for
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import vision_problems

__all__ = [
    "MODEL_NAMES",
    "check_attention_backend",
    "check_config",
    "compute_dtype",
    "runs_seq1f1b",
]

# Models verified under Seq1F1B (README's model table).
MODEL_NAMES = ("llama3", "qwen3", "qwen3_5", "deepseek_v3", "gpt_oss", "kimi_k2_5")



def runs_seq1f1b(config: Trainer.Config) -> bool:
    """Whether this job pipelines under a Seq1F1B schedule."""
    return (
        config.parallelism.pipeline_parallel_degree > 1
        and config.seq1f1b.schedule != NO_SCHEDULE
    )


def check_config(config: Trainer.Config) -> None:
    """Raise :class:`Seq1F1BConfigError` listing every reason Seq1F1B cannot run ``config``.

    ``config.seq1f1b`` is a :class:`Seq1F1BSection`. A job that does not
    pipeline under Seq1F1B is refused context parallelism on CPU only, where
    its attention becomes the segment-aware one too, which cuts no CP shares.
    """
    problems = data_problems(config)
    parallelism = config.parallelism
    if (
        parallelism.context_parallel_degree > 1
        and utils.device_type == "cpu"
        and not runs_seq1f1b(config)
    ):
        problems.append(
            f"parallelism.context_parallel_degree={parallelism.context_parallel_degree} "
            "without a Seq1F1B schedule: on CPU only Seq1F1B's schedules run CP; set "
            "--parallelism.pipeline_parallel_degree 2 (or more), or set it to 1"
        )
    if runs_seq1f1b(config):
        problems += _seq1f1b_problems(config)
    elif (
        utils.device_type == "cpu"
        and parallelism.pipeline_parallel_degree > 1
        and config.activation_checkpoint is not None
    ):
        # The CPU attention binds each forward's documents to the model; torch's
        # schedules recompute a checkpointed microbatch after later forwards.
        problems.append(
            f"seq1f1b.schedule={NO_SCHEDULE!r} pipelines with torchtitan's own schedule, "
            "whose CPU attention cannot recompute activation-checkpointed microbatches "
            "with their own documents; use activation_checkpoint:none, or a Seq1F1B "
            "schedule (--seq1f1b.schedule Seq1F1B)"
        )
    if problems:
        raise Seq1F1BConfigError("Seq1F1B cannot run this job:\n  - " + "\n  - ".join(problems))


def _seq1f1b_problems(config: Trainer.Config) -> list[str]:
    options: Seq1F1BSection = config.seq1f1b
    parallelism = config.parallelism
    entry = SCHEDULES[options.schedule]
    spec = config.model_spec
    if spec is not None and spec.name not in MODEL_NAMES:
        return [
            f"model {spec.name!r}: it is not verified under Seq1F1B; Seq1F1B supports "
            f"{list(MODEL_NAMES)}"
        ]
    problems = []
    if spec is not None:
        problems += vision_problems(
            spec.name, config.dataloader, parallelism.context_parallel_degree
        )
        problems += gated_delta_net_problems(
            spec.model, parallelism.tensor_parallel_degree, parallelism.context_parallel_degree
        )
    if spec is not None and getattr(spec.model, "mtp_layers", None):
        problems.append(
            f"model {spec.name!r} predicts {len(spec.model.mtp_layers)} extra token(s) "
            "(multi-token prediction), which torchtitan does not pipeline; use its config "
            "without MTP (e.g. deepseek_v3_debugmodel for deepseek_v3_debugmodel_mtp), or "
            "--parallelism.pipeline_parallel_degree 1"
        )
    if parallelism.pipeline_parallel_schedule != entry.layout_of:
        problems.append(
            f"seq1f1b.schedule={options.schedule!r} runs on the stage layout of "
            f"{entry.layout_of!r}, but parallelism.pipeline_parallel_schedule="
            f"{parallelism.pipeline_parallel_schedule!r}; set "
            f"--parallelism.pipeline_parallel_schedule {entry.layout_of}, or "
            f"--seq1f1b.schedule {NO_SCHEDULE} for torchtitan's own schedule"
        )
    problems += shared_problems(
        parallelism,
        config.compile,
        options.num_segments,
        options.schedule,
        options.schedule in SPLIT_BACKWARD_SCHEDULES,
        "drop --compile.enable, or use --seq1f1b.schedule InterleavedSeq1F1B or Seq1F1B, "
        "which compile",
    )
    if options.schedule in SPLIT_BACKWARD_SCHEDULES and isinstance(
        config.activation_checkpoint, SelectiveAC.Config
    ):
        problems.append(
            f"activation_checkpoint:selective cannot run under seq1f1b.schedule="
            f"{options.schedule!r}: torch's op-level checkpointing allows one backward "
            "per region, and split backwards run two (input, then weight gradients); "
            "use activation_checkpoint:full or activation_checkpoint:none, or "
            "seq1f1b.schedule='Seq1F1B'"
        )
    problems += planner_problems(options)
    problems += context_parallel_problems(parallelism)
    if parallelism.context_parallel_degree > 1 and parallelism.spmd_backend != "spmd_types":
        problems.append(
            f"parallelism.spmd_backend={parallelism.spmd_backend!r} with "
            f"context_parallel_degree={parallelism.context_parallel_degree}: that backend "
            "applies torchtitan's own CP to the attention, over the whole sequence; "
            "Seq1F1B runs CP per segment under --parallelism.spmd_backend spmd_types"
        )
    validator = getattr(config, "validator", None)
    if parallelism.context_parallel_degree > 1 and validator is not None and validator.enable:
        problems.append(
            f"validator.enable with context_parallel_degree={parallelism.context_parallel_degree}: "
            "torchtitan's validator shards whole sequences for its own CP, not per segment; "
            "drop --validator.enable, or validate in a job without CP"
        )
    # A planned plan is chosen on the device, in the pipelining function.
    fixed_k = isinstance(options.num_segments, int) and options.num_segments >= 1
    if fixed_k and not uses_planner(options) and spec is not None:
        try:
            plan = segment_plan_for(
                options, sequence_length(config.training), parallelism.tensor_parallel_degree,
                spec.model, cp=parallelism.context_parallel_degree,
            )
        except Seq1F1BConfigError as error:
            problems.append(str(error))
        else:
            problems += _chunked_loss_problems(config, plan.lengths)
    elif uses_planner(options):
        problems += _planned_chunked_loss_problems(config)
    return problems


def _planned_chunked_loss_problems(config: Trainer.Config) -> list[str]:
    """The planner's lengths are multiples of lcm(align, sequence shards), and of
    nothing else."""
    loss, options, parallelism = config.loss, config.seq1f1b, config.parallelism
    if not isinstance(loss, ChunkedLossWrapper.Config):
        return []
    cp = parallelism.context_parallel_degree
    align = plan_align(
        options, sequence_length(config.training), parallelism.tensor_parallel_degree,
        cp, torch.cuda.is_available(),
    )
    if align % (loss.num_chunks * cp) == 0:
        return []
    return [
        f"loss.num_chunks={loss.num_chunks} must divide every segment length{_per_rank(cp)} "
        f"(the chunked loss cuts each segment's output), but seq1f1b.num_segments="
        f"{options.num_segments!r} / partition={options.partition!r} let the planner choose "
        f"lengths that are only multiples of {align} (seq1f1b.align x tp x 2 * cp); raise "
        f"seq1f1b.align to a multiple of {loss.num_chunks * cp}, or lower loss.num_chunks"
    ]


def _per_rank(cp: int) -> str:
    return f" / context_parallel_degree={cp}" if cp > 1 else ""


def _chunked_loss_problems(config: Trainer.Config, lengths: tuple[int, ...]) -> list[str]:
    """Under CP each rank's loss gets its share of a segment, ``length / cp`` tokens."""
    loss, cp = config.loss, config.parallelism.context_parallel_degree
    if not isinstance(loss, ChunkedLossWrapper.Config):
        return []
    if all(length % (loss.num_chunks * cp) == 0 for length in lengths):
        return []
    return [
        f"loss.num_chunks={loss.num_chunks} must divide every segment length{_per_rank(cp)} "
        f"{[length // cp for length in lengths]} (the chunked loss cuts each segment's output); "
        f"raise seq1f1b.align to a multiple of {loss.num_chunks * cp}, or lower loss.num_chunks"
    ]


def compute_dtype(training: TrainingConfig, parallel_dims: ParallelDims) -> torch.dtype:
    """The dtype activations are computed in.

    torchtitan casts parameters to ``training.mixed_precision_param`` only
    through FSDP; otherwise they keep ``training.dtype``.
    """
    return TORCH_DTYPE_MAP[
        training.mixed_precision_param if parallel_dims.fsdp_enabled else training.dtype
    ]


def check_attention_backend(
    options: Seq1F1BSection,
    training: TrainingConfig,
    parallel_dims: ParallelDims,
    head_dim: int,
    device: torch.device,
) -> None:
    """Raise :class:`Seq1F1BConfigError` if ``seq1f1b.attention_backend`` cannot run here."""
    dtype = compute_dtype(training, parallel_dims)
    target = KernelTarget(torch.device(device), dtype, head_dim)
    try:
        check_backend(options.attention_backend, target)
    except ValueError as error:
        raise Seq1F1BConfigError(f"Seq1F1B cannot run this job: seq1f1b.{error}") from None

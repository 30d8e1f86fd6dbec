# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan pipelining function that adds the Seq1F1B schedule names.

"Seq1F1B", "InterleavedSeq1F1B", "Seq1F1BZeroBubble" and "Seq1F1BZBV" select
the schedules of :mod:`torchtitan_seq1f1b.schedules`; every other
``pipeline_parallel_schedule`` goes to torchtitan's own ``pipeline_llm``
untouched. The model is split into stages as torchtitan splits it for the
torch schedule with the same layout (1F1B: one stage per rank;
Interleaved1F1B: ``pipeline_parallel_layers_per_stage`` decides, 2 per rank by
default; ZBVZeroBubble: 2 per rank in a V), torchtitan's ``parallelize_fn``
(TP, AC, FSDP) is applied to each part, the attention ops become
segment-aware, and the parts run with a plan derived from
``training.seq_len``, ``[seq1f1b]`` and the model's dims. Under context
parallelism the schedule cuts each segment over the CP mesh.
"""

import math

import torch
import torch.nn as nn

from torchtitan.components.loss import LossFunction
from torchtitan.config import JobConfig, TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    generate_llm_fqn_per_model_part,
    pipeline_llm,
    pipeline_module_split,
)
from torchtitan.protocols.train_spec import BaseModelArgs, ParallelizeFunction
from torchtitan.tools.logging import logger

from torchtitan_seq1f1b.attention import check_backend, KernelTarget
from torchtitan_seq1f1b.integration.titan_0_2.attention import (
    attention_problem,
    make_segment_aware,
    MASKS_KWARG,
    uses_document_ids,
)
from torchtitan_seq1f1b.integration.config_problems import shared_problems
from torchtitan_seq1f1b.integration.context_parallel import (
    context_group,
    context_parallel_problems,
)
from torchtitan_seq1f1b.integration.segment_plan import (
    plan_segments,
    planner_problems,
    PlannerJob,
    Seq1F1BConfigError,
)
from torchtitan_seq1f1b.integration.schedules import SCHEDULES, ScheduleEntry, SPLIT_BACKWARD_SCHEDULES
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = [
    "Seq1F1BConfigError",
    "attention_target",
    "check_job",
    "module_names_per_stage",
    "pipeline_llm_seq1f1b",
    "segment_plan_for",
    "transformer_cost",
]


def pipeline_llm_seq1f1b(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    model_args: BaseModelArgs,
    parallelize_fn: ParallelizeFunction,
    loss_fn: LossFunction,
) -> tuple[ScheduleSeq1F1B, list[nn.Module], bool, bool]:
    """Drop-in for torchtitan's ``pipeline_llm`` (a ``TrainSpec.pipelining_fn``)."""
    parallelism = job_config.parallelism
    name = parallelism.pipeline_parallel_schedule
    entry = SCHEDULES.get(name)
    if entry is None:
        return pipeline_llm(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn
        )

    # Every check below depends on the config only, so all ranks raise alike
    # before the first pipeline message.
    check_job(job_config, parallel_dims, model_args, device)
    module_names = module_names_per_stage(job_config, parallel_dims, model_args, entry)
    backend = job_config.seq1f1b.attention_backend
    n_microbatches = (
        job_config.training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    )
    planner_job = PlannerJob.for_stages(
        model,
        module_names,
        parallel_dims,
        entry.schedule_class,
        parallelism.pipeline_parallel_microbatch_size,
        n_microbatches,
        device,
        attention_target(job_config, parallel_dims, model_args, device).dtype,
    )
    plan = segment_plan_for(job_config, model, parallel_dims, planner_job)

    stages, model_parts = pipeline_module_split(
        model,
        parallel_dims.get_mesh("pp"),
        entry.layout_of,
        device,
        module_names,
    )
    context = context_group(parallel_dims)
    for i, part in enumerate(model_parts):
        if context is None:
            make_segment_aware(part, backend)
        part = parallelize_fn(part, parallel_dims, job_config)
        if context is not None:
            # torchtitan hooks its whole-sequence CP onto the attention it finds; the
            # segment-aware attention replaces that one and cuts CP per segment.
            make_segment_aware(part, backend)
        model_parts[i] = stages[i].submod = part

    # Flex/varlen models hand their documents to every stage as attention_masks
    # (see make_segment_aware); the schedule takes them from there.
    documents = uses_document_ids(model_args)
    schedule = entry.schedule_class(
        stages,
        n_microbatches=n_microbatches,
        segment_plan=plan,
        loss_fn=loss_fn,
        positions_kwarg="positions",
        document_ids_kwarg=MASKS_KWARG if documents else None,
        context_parallel=context,
    )
    logger.info(
        f"Using pipeline schedule {name} with {n_microbatches} microbatches "
        f"x {plan.num_segments} segments {list(plan.lengths)} over "
        f"{len(module_names)} stages on {parallel_dims.pp} ranks, "
        f"attention_backend={backend}"
        + (f", attn_mask_type={model_args.attn_mask_type}" if documents else "")
        + (f", context parallel {parallel_dims.cp} per segment" if context else "")
    )
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    return schedule, model_parts, has_first, has_last


def segment_plan_for(
    job_config: JobConfig,
    model: nn.Module,
    parallel_dims: ParallelDims,
    planner_job: PlannerJob | None = None,
) -> SegmentPlan:
    """The plan ``[seq1f1b]`` asks for at ``training.seq_len`` (model may be on meta);
    ``planner_job`` is needed when the options leave the plan to the planner."""
    return plan_segments(
        job_config.seq1f1b,
        job_config.training.seq_len,
        parallel_dims.tp,
        transformer_cost(model),
        planner_job,
        logger.info,
        parallel_dims.cp,
    )


def transformer_cost(model: nn.Module) -> TransformerCost:
    """The FLOP model of a torchtitan llama3 ``Transformer`` from its real dims."""
    args = model.model_args
    block = next(iter(model.layers.values()))
    return TransformerCost(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads or args.n_heads,
        ffn_hidden_dim=block.feed_forward.w1.out_features,
        vocab_size=args.vocab_size,
    )


def attention_target(
    job_config: JobConfig, parallel_dims: ParallelDims, model_args: BaseModelArgs, device
) -> KernelTarget:
    """Device, dtype and head_dim the attention kernels will see in this job."""
    # torchtitan casts to mixed_precision_param only through FSDP when
    # pipelining (maybe_enable_amp); otherwise parameters stay float32.
    dtype = (
        TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
        if parallel_dims.fsdp_enabled
        else torch.float32
    )
    return KernelTarget(torch.device(device), dtype, model_args.dim // model_args.n_heads)


def check_job(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: BaseModelArgs,
    device: torch.device,
) -> None:
    """Raise :class:`Seq1F1BConfigError` listing every option of the job Seq1F1B cannot run."""
    parallelism = job_config.parallelism
    options = job_config.seq1f1b
    problems = []
    target = attention_target(job_config, parallel_dims, model_args, device)
    try:
        check_backend(options.attention_backend, target)
    except ValueError as error:
        problems.append(f"seq1f1b.{error}")
    ac = job_config.activation_checkpoint
    split_backward = parallelism.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
    if split_backward and ac.mode == "selective" and ac.selective_ac_option == "op":
        problems.append(
            f"activation_checkpoint.mode='selective' with selective_ac_option='op' "
            f"cannot run under {parallelism.pipeline_parallel_schedule}: torch's "
            "op-level checkpointing allows one backward per region, and split "
            "backwards run two (input, then weight gradients); use mode='full', or "
            "selective_ac_option as a layer count (e.g. '2'), or the Seq1F1B schedule"
        )
    problems += context_parallel_problems(parallelism)
    if parallel_dims.cp > 1 and job_config.validation.enable:
        problems.append(
            f"validation.enable with context_parallel_degree={parallel_dims.cp}: "
            "torchtitan's validator shards whole sequences for its own CP, not per "
            "segment; set validation.enable = false, or validate in a job without CP"
        )
    problem = attention_problem(model_args)
    if problem:
        problems.append(
            f"model.flavor={job_config.model.flavor!r}: {problem}; use a flavor "
            "with attn_type='sdpa', or 'flex'/'varlen' with "
            "attn_mask_type='block_causal'"
        )
    problems += shared_problems(
        parallelism,
        job_config.compile,
        options.num_segments,
        parallelism.pipeline_parallel_schedule,
        split_backward,
        "set compile.enable=false, or use InterleavedSeq1F1B or Seq1F1B, which compile",
    )
    problems += planner_problems(options)
    validation = job_config.validation
    if validation.enable and validation.seq_len != job_config.training.seq_len:
        problems.append(
            f"validation.seq_len={validation.seq_len} differs from training.seq_len="
            f"{job_config.training.seq_len}; the segment plan serves both, so set "
            "them equal"
        )
    batch, microbatch = (
        job_config.training.local_batch_size,
        parallelism.pipeline_parallel_microbatch_size,
    )
    if microbatch < 1 or batch % microbatch:
        problems.append(
            f"training.local_batch_size={batch} must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size={microbatch}"
        )
    if problems:
        raise Seq1F1BConfigError(
            "Seq1F1B cannot run this job:\n  - " + "\n  - ".join(problems)
        )


def module_names_per_stage(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: BaseModelArgs,
    entry: ScheduleEntry,
) -> list[list[str]]:
    """The model parts, as torchtitan splits them for ``entry.layout_of``.

    Single-stage schedules need one part per pipeline rank; interleaved ones
    a multiple of the pipeline degree with at least two parts per rank (two
    unless ``pipeline_parallel_layers_per_stage`` says otherwise).
    """
    parallelism = job_config.parallelism
    name, pp = parallelism.pipeline_parallel_schedule, parallel_dims.pp
    names = parallelism.module_fqns_per_model_part
    if names is not None:
        _check_stage_count(
            len(names), pp, name, entry,
            f"parallelism.module_fqns_per_model_part has {len(names)} parts",
        )
        return names
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    first_less = parallelism.pipeline_parallel_first_stage_less_layers
    last_less = parallelism.pipeline_parallel_last_stage_less_layers
    if layers_per_stage is None:
        num_stages = entry.min_stages_per_rank * pp
    else:
        num_stages = math.ceil((model_args.n_layers + first_less + last_less) / layers_per_stage)
        _check_stage_count(
            num_stages, pp, name, entry,
            f"parallelism.pipeline_parallel_layers_per_stage={layers_per_stage} "
            f"gives {num_stages} stages",
        )
    return generate_llm_fqn_per_model_part(
        num_stages, model_args.n_layers, first_less, last_less
    )


def _check_stage_count(
    num_stages: int, pp: int, name: str, entry: ScheduleEntry, source: str
) -> None:
    low, high = entry.min_stages_per_rank, entry.max_stages_per_rank
    if num_stages % pp == 0 and low <= num_stages // pp <= (high or num_stages):
        return
    if high == 1:
        need = f"one stage per pipeline rank ({pp} stages)"
        other = "use InterleavedSeq1F1B or Seq1F1BZBV for several stages per rank"
    elif high == low:
        need = f"exactly {low} stages per pipeline rank ({low * pp} stages)"
        other = "use InterleavedSeq1F1B for any number of stages per rank"
    else:
        need = (
            f"a multiple of the pipeline degree ({pp}) with at least {low} stages "
            f"per rank, e.g. {low * pp}"
        )
        other = "use Seq1F1B for one stage per rank"
    raise Seq1F1BConfigError(f"{source}, but {name} needs {need}; adjust it, or {other}")

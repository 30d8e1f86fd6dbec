# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3 pipelining function that runs a Seq1F1B schedule.

It does what torchtitan's ``pipeline_llm`` does -- split the model into stages
for the stage layout of ``parallelism.pipeline_parallel_schedule`` (one stage
per rank for "1F1B", ``pipeline_parallel_layers_per_stage`` or 2 per rank
for "Interleaved1F1B", 2 per rank in a V for "ZBVZeroBubble"; a VLM's vision
encoder on the first, as ``pipeline_vlm``), apply ``parallelize_fn`` (TP, AC,
FSDP) to every part -- except that the attention ops (and a VLM's image
scatter) become segment-aware before parallelizing and the stages run under the
Seq1F1B schedule ``seq1f1b.schedule`` names, with a segment plan derived from
the sequence length (:mod:`.release`), the ``seq1f1b`` options and the model's dims. Under
context parallelism the schedule cuts each segment over the CP mesh. With
``seq1f1b.schedule = "none"`` it is ``pipeline_llm`` (``pipeline_vlm``).
Where ``pipeline_llm`` takes a ``schedule_builder`` (the torchtitan core patch
of :mod:`torchtitan_seq1f1b.upstream`), it is a ``pipeline_llm`` call with that
hook; otherwise it repeats ``pipeline_llm``'s split-and-parallelize loop.

Loss normalisation is torchtitan 0.3's: the trainer passes
``loss_kwargs={"global_valid_tokens": ...}`` to ``step()`` and the loss
divides by it, so the schedule runs with ``scale_grads=False`` and divides
by nothing.
"""

import dataclasses
import inspect

import torch
import torch.nn as nn

from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import ChunkedLossWrapper, LossFunction
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.pipeline_parallel import (
    _build_get_mesh_callback,
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _pipeline_module_split,
    pipeline_llm,
    pipeline_vlm,
)
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ParallelizeFunction
from torchtitan.tools.logging import logger

from torchtitan_seq1f1b.integration.context_parallel import context_group
from torchtitan_seq1f1b.integration.schedules import SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from torchtitan_seq1f1b.integration.segment_plan import PlannerJob
from torchtitan_seq1f1b.integration.titan_0_3.config_checks import (
    check_attention_backend,
    compute_dtype,
)
from torchtitan_seq1f1b.integration.titan_0_3.contiguous import send_contiguous
from torchtitan_seq1f1b.integration.titan_0_3.attention import make_segment_aware, MASKS_KWARG
from torchtitan_seq1f1b.integration.titan_0_3.options import NO_SCHEDULE, Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.release import (
    microbatch_rows,
    num_microbatches,
    SEQ_DIM,
    sequence_length,
)
from torchtitan_seq1f1b.integration.titan_0_3.segment_plan import attention_head_dim, segment_plan_for
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import (
    IMAGE_KWARGS,
    segment_aware_images,
)
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["pipeline_llm_seq1f1b"]

# torchtitan's schedule hook (upstream's core patch): pipeline_llm builds our schedule.
_HAS_SCHEDULE_HOOK = "schedule_builder" in inspect.signature(pipeline_llm).parameters


def pipeline_llm_seq1f1b(
    model: nn.Module,
    *,
    options: Seq1F1BSection,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
    device: torch.device,
    model_config: BaseModel.Config,
    parallelize_fn: ParallelizeFunction,
    loss_fn: LossFunction,
) -> tuple[ScheduleSeq1F1B, list[nn.Module], bool, bool]:
    """``ModelSpec.pipelining_fn`` with ``options`` bound (``functools.partial``).

    The job was checked (:func:`~.config_checks.check_config`) before the
    trainer initialised anything.
    """
    parallelize_kwargs = dict(
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=dump_folder,
    )
    vision = getattr(model, "vision_encoder", None) is not None
    if options.schedule == NO_SCHEDULE:
        return (pipeline_vlm if vision else pipeline_llm)(
            model,
            **parallelize_kwargs,
            device=device,
            model_config=model_config,
            parallelize_fn=parallelize_fn,
            loss_fn=loss_fn,
        )
    entry = SCHEDULES[options.schedule]
    check_attention_backend(
        options, training, parallel_dims, attention_head_dim(model_config), device
    )
    # Stage counts are checked against pipeline_parallel_schedule, a torch name.
    num_stages, num_layers, input_weight, output_weight = _get_pipeline_metadata(
        parallel_dims, parallelism, model_config
    )
    module_names = parallelism.module_fqns_per_model_part
    if not module_names:
        module_names = _generate_llm_fqn_per_model_part(
            num_stages, num_layers, input_weight, output_weight
        )
        if vision:  # pipeline_vlm's split: the encoder beside the token embeddings
            module_names[0].insert(0, "vision_encoder")
    n_microbatches = num_microbatches(training, parallelism)
    planner_job = PlannerJob.for_stages(
        model,
        module_names,
        parallel_dims,
        entry.schedule_class,
        microbatch_rows(parallelism),
        n_microbatches,
        device,
        compute_dtype(training, parallel_dims),
    )
    plan = segment_plan_for(
        options, sequence_length(training), parallel_dims.tp, model_config, planner_job,
        parallel_dims.cp,
    )
    make_segment_aware(model, options.attention_backend)

    def parallelize(part: nn.Module, **kwargs) -> nn.Module:
        if hasattr(part, "vision_encoder"):
            segment_aware_images(part)
        part = parallelize_fn(part, **kwargs)
        send_contiguous(part)
        return part

    def build_schedule(*, stages: list, loss_fn: LossFunction, **_) -> ScheduleSeq1F1B:
        return entry.schedule_class(
            stages,
            n_microbatches=n_microbatches,
            segment_plan=plan,
            loss_fn=_ScalarLoss(loss_fn, options.schedule in SPLIT_BACKWARD_SCHEDULES),
            scale_grads=False,
            seq_dim=SEQ_DIM,
            positions_kwarg="positions",
            document_ids_kwarg=MASKS_KWARG,
            context_parallel=context_group(parallel_dims),
            whole_kwargs=IMAGE_KWARGS,
        )

    if _HAS_SCHEDULE_HOOK:
        split = dataclasses.replace(parallelism, module_fqns_per_model_part=module_names)
        schedule, model_parts, has_first, has_last = pipeline_llm(
            model,
            **{**parallelize_kwargs, "parallelism": split},
            device=device,
            model_config=model_config,
            parallelize_fn=parallelize,
            loss_fn=loss_fn,
            schedule_builder=build_schedule,
        )
    else:  # pipeline_llm's split-and-parallelize loop, then our schedule
        stages, model_parts = _pipeline_module_split(
            model,
            parallel_dims.get_mesh("pp"),
            parallelism.pipeline_parallel_schedule,
            device,
            module_names,
            get_mesh=_build_get_mesh_callback(parallel_dims),
        )
        for i, part in enumerate(model_parts):
            model_parts[i] = stages[i].submod = parallelize(part, **parallelize_kwargs)
        schedule = build_schedule(stages=stages, loss_fn=loss_fn)
        has_first = any(stage.is_first for stage in stages)
        has_last = any(stage.is_last for stage in stages)
    logger.info(
        f"Using pipeline schedule {options.schedule} on the stage layout of "
        f"{parallelism.pipeline_parallel_schedule} with {n_microbatches} microbatches "
        f"x {plan.num_segments} segments {list(plan.lengths)} over {len(module_names)} "
        f"stages on {parallel_dims.pp} ranks, attention_backend={options.attention_backend}"
        + (f", context parallel {parallel_dims.cp} per segment" if parallel_dims.cp > 1 else "")
    )
    return schedule, model_parts, has_first, has_last


class _ScalarLoss:
    """torchtitan 0.3's loss returns ``(loss, metrics)``; pipeline schedules take the loss.

    ``loss_fn(output, target, global_valid_tokens=...)`` is the segment's sum of
    token losses divided by the step's global valid-token count.

    Under a split backward (``split_backward``), a ``ChunkedLossWrapper`` whose
    FSDP-wrapped ``lm_head`` it reshards at the end is unsharded again: torch's
    input-gradient step finds the weights whose gradients it defers among the
    stage's registered parameters, which must be the unsharded ones the forward
    used (the final norm shares ``lm_head``'s FSDP group and would get none).
    """

    def __init__(self, loss_fn: LossFunction, split_backward: bool):
        self.loss_fn = loss_fn
        self._unshards_head = split_backward and isinstance(loss_fn, ChunkedLossWrapper)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        loss, _ = self.loss_fn(*args, **kwargs)
        # The trainer sets lm_head after pipelining; only a training forward reshards it.
        head = self.loss_fn.lm_head if self._unshards_head else None
        if isinstance(head, FSDPModule) and loss.requires_grad:
            head.unshard()
        return loss

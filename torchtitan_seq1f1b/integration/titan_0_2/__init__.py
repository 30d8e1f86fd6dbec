# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The torchtitan 0.2.2 adapter: Seq1F1B as a ``pipeline_parallel_schedule``.

``install()`` runs when the package is imported inside a torchtitan job
(``[experimental] custom_import`` or ``[job] custom_config_module``):

- torchtitan's config parsing names the valid ``[seq1f1b]`` keys and schedule
  names, with the closest one, when a job misspells them;
- the llama3 train spec gets :func:`pipeline_llm_seq1f1b` as its pipelining
  function (every schedule name but "Seq1F1B", "InterleavedSeq1F1B",
  "Seq1F1BZeroBubble" and "Seq1F1BZBV" still goes to torchtitan's own)
  and a metrics processor with Seq1F1B's figures;
- the trainer hands its global valid-token count to the schedule;
- op-level selective checkpointing saves the attention backends' forward ops
  (llama3's save list), rather than rerunning attention in backward;
- the shipped dataset is registered, and a TOML's repo-relative path to the
  shipped tokenizer also works from an installed package;
- on a machine without an accelerator, torchtitan runs on CPU with gloo, and
  unpipelined flex/varlen (``block_causal``) models train with the
  segment-aware attention, which computes the same masks
  (:func:`parallelize_with_document_ids`).
"""

import dataclasses

from torchtitan.components.tokenizer import build_hf_tokenizer, HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.models.llama3.infra import parallelize as llama3_parallelize
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from torchtitan_seq1f1b.attention import attention_forward_ops
from torchtitan_seq1f1b.data import register_datasets, resolve_hf_assets_path
from torchtitan_seq1f1b.integration.cpu import enable_cpu_training
from torchtitan_seq1f1b.integration.titan_0_2.attention import parallelize_with_document_ids
from torchtitan_seq1f1b.integration.titan_0_2.config_checks import install_config_checks
from torchtitan_seq1f1b.integration.titan_0_2.metrics import build_seq1f1b_metrics_processor
from torchtitan_seq1f1b.integration.titan_0_2.pipeline import pipeline_llm_seq1f1b
from torchtitan_seq1f1b.integration.titan_0_2.trainer import install_trainer_hook

__all__ = ["install", "pipeline_llm_seq1f1b"]

MODEL_NAMES = ("llama3",)

# Modules that copy ``device_type`` / ``device_module`` out of
# torchtitan.tools.utils at import time (torchtitan 0.2.2).
DEVICE_CONSUMERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
)


def install() -> None:
    """Idempotent; see the module docstring."""
    install_config_checks()
    on_cpu = enable_cpu_training(DEVICE_CONSUMERS)
    register_datasets()
    llama3_parallelize._op_sac_save_list.update(attention_forward_ops())
    for name in MODEL_NAMES:
        spec = original = get_train_spec(name)
        if spec.pipelining_fn is not pipeline_llm_seq1f1b:
            spec = dataclasses.replace(
                spec,
                pipelining_fn=pipeline_llm_seq1f1b,
                build_tokenizer_fn=build_tokenizer,
                build_metrics_processor_fn=build_seq1f1b_metrics_processor,
            )
        if on_cpu and not getattr(spec.parallelize_fn, "_seq1f1b", False):
            spec = dataclasses.replace(
                spec, parallelize_fn=parallelize_with_document_ids(spec.parallelize_fn)
            )
        if spec is not original:
            register_train_spec(name, spec)
    install_trainer_hook()


def build_tokenizer(job_config: JobConfig) -> HuggingFaceTokenizer:
    job_config.model.hf_assets_path = resolve_hf_assets_path(job_config.model.hf_assets_path)
    return build_hf_tokenizer(job_config)

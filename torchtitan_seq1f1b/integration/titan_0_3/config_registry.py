# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B job configs for torchtitan 0.3 (``--module ... --config <function>``).

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module torchtitan_seq1f1b --config seq1f1b_debug

Any field is a flag on the same command: ``--parallelism.pipeline_parallel_degree 1``
is the non-pipelined reference, ``--seq1f1b.num_segments 2`` another plan. Any
other name is torchtitan's own config of that name, as a Seq1F1B job
(:mod:`.torchtitan_configs`).
"""

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_8b

from torchtitan_seq1f1b.data import TOKENIZER_DIR
from torchtitan_seq1f1b.integration.titan_0_3.job_data import recall_loader
from torchtitan_seq1f1b.integration.titan_0_3.metrics import Seq1F1BMetricsProcessor
from torchtitan_seq1f1b.integration.titan_0_3.options import Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.integration.titan_0_3.torchtitan_configs import seq1f1b_config, seq1f1b_job
from torchtitan_seq1f1b.integration.titan_0_3.trainer import Seq1F1BTrainer

if FOLDED:
    from torchtitan.components.checkpointer import CheckpointManager
else:
    from torchtitan.components.checkpoint import CheckpointManager

__all__ = ["seq1f1b_debug", "seq1f1b_llama3_8b_128k"]

# The debug job's recall corpus, words from a pool of 64: one 65-token document per
# 64-token row on 0.3; on main two 128-token documents per 256-token microbatch, each
# across two segments.
_DEBUG_CORPUS = "doc_tokens=129,words=64" if FOLDED else "doc_tokens=65,words=64"


def seq1f1b_debug() -> Seq1F1BTrainer.Config:
    """The llama3 debug model, PP=2 under Seq1F1B with k=4 balanced segments, on CPU or GPU.

    The data (a long-range recall corpus: every document's second half repeats
    its first half) and the tokenizer ship with the package; nothing is
    downloaded. Each 64-token window is one document cut into 4 segments of
    about 16 tokens, so every copied word's source lies in an earlier segment.
    Checkpoints go to ./outputs/seq1f1b_debug/checkpoint; running the command
    again resumes from the latest.
    """
    model_spec = model_registry("debugmodel")
    return Seq1F1BTrainer.Config(
        dump_folder="./outputs/seq1f1b_debug",
        hf_assets_path=str(TOKENIZER_DIR),
        model_spec=model_spec,
        # Whole-segment logits: a chunked loss would need every segment length
        # to be a multiple of its chunk count.
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=default_adamw(lr=1e-2),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=20, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0
        ),
        training=_debug_training(),
        dataloader=recall_loader("train", _DEBUG_CORPUS),
        metrics=Seq1F1BMetricsProcessor.Config(log_freq=5, enable_tensorboard=True),
        parallelism=_debug_parallelism(),
        seq1f1b=Seq1F1BSection(schedule="Seq1F1B", num_segments=4, partition="balanced"),
        checkpoint=CheckpointManager.Config(
            enable=True, interval=100, last_save_model_only=False
        ),
        activation_checkpoint=None,
        # --validator.enable turns it on; Seq1F1B evaluates with the training plan.
        validator=Validator.Config(
            freq=50,
            steps=4,
            dataloader=recall_loader("validation", _DEBUG_CORPUS),
        ),
        debug=DebugConfig(seed=0),
    )


def _debug_training() -> TrainingConfig:
    """2 microbatches a step: of 8 rows of 64 tokens on 0.3, of one packed row of 256 on
    main (where a step without PP is one row: the reference accumulates two,
    ``--training.num_tokens_per_train_step 512``)."""
    # CPU has no fast bf16; float32 keeps runs comparable. torchtitan refuses CUDA
    # graphs with pipeline parallelism.
    common = dict(
        steps=300, max_norm=1.0, mixed_precision_param="float32", disable_cuda_graphs=True
    )
    if FOLDED:
        return TrainingConfig(
            num_tokens_per_microbatch_per_dp_rank=256,
            max_context_length=128,
            **common,
        )
    return TrainingConfig(local_batch_size=16, seq_len=64, **common)


def _debug_parallelism() -> ParallelismConfig:
    if FOLDED:
        return ParallelismConfig(
            pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B", num_pp_microbatches=2
        )
    return ParallelismConfig(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=8,
    )


def seq1f1b_llama3_8b_128k() -> Seq1F1BTrainer.Config:
    """Llama 3 8B on 128k-token sequences: context parallel 2 x PP 4 under Seq1F1B.

    For one node of 8 x H100 80GB with flash-attn (``pip install
    'torchtitan-seq1f1b[flash]'``), on torchtitan's ``llama3_8b`` (C4, its
    tokenizer under ./assets/hf/Llama-3.1-8B). Every stage holds 8 of the 32
    layers; each CP rank holds 64k tokens of every sequence. 8 microbatches of
    one sequence, k = 8 balanced segments (multiples of 128 tokens, which CP
    cuts into 4 pieces), full activation checkpointing. Not run in CI (no GPU
    there); its plan and start-up checks are tested.

        torchrun --nproc_per_node 8 -m torchtitan.train \\
            --module torchtitan_seq1f1b --config seq1f1b_llama3_8b_128k
    """
    config = seq1f1b_job(llama3_8b(), "llama3_8b")
    config.dump_folder = "./outputs/seq1f1b_llama3_8b_128k"
    parallelism = config.parallelism
    parallelism.pipeline_parallel_degree = 4
    parallelism.context_parallel_degree = 2
    if FOLDED:
        config.training.num_tokens_per_microbatch_per_dp_rank = 131072
        config.training.max_context_length = 131072
        parallelism.num_pp_microbatches = 8
        parallelism.spmd_backend = "spmd_types"
    else:
        config.training.seq_len = 131072
        config.training.local_batch_size = 8
        parallelism.pipeline_parallel_microbatch_size = 1
    config.activation_checkpoint = FullAC.Config()
    config.seq1f1b = Seq1F1BSection(
        schedule="Seq1F1B", num_segments=8, partition="balanced",
        attention_backend="flash", align=128,
    )
    return config


def __getattr__(name: str):
    # Called for names this module lacks: torchtitan's own configs, or a clear error.
    if name.startswith("_"):
        raise AttributeError(name)
    return seq1f1b_config(name, __all__)

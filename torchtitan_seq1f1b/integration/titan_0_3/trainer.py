# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's ``Trainer`` with a ``seq1f1b`` config section.

torchtitan 0.3 needs no trainer patch for Seq1F1B: it hands pipeline
schedules the global valid-token count through ``loss_kwargs``, and it calls
``ModelSpec.pipelining_fn`` with keyword arguments but without the config,
so the subclass binds the ``seq1f1b`` options into the pipelining function.
Before the base trainer initialises anything, every rank checks the config
(:func:`~.config_checks.check_config`). On a machine without an accelerator
the attention of an unpipelined model, or of one under torch's schedules,
becomes the segment-aware one too (torchtitan's flex and varlen attention
cannot train on CPU), so such a run computes the same math as a Seq1F1B one;
a vision encoder's flex attention is computed densely (:mod:`.vision_attention`).
Op-level selective checkpointing saves the attention backends' forward ops
(:mod:`.checkpointing`). Under context parallelism a Seq1F1B schedule gets
whole sequences and cuts every segment over the CP ranks itself.
With a :class:`~.metrics.Seq1F1BMetricsProcessor`, Seq1F1B jobs log the
segment plan, the K/V store peak and the bubble estimate, and end with the
run summary (on the recall corpus: the loss next to the lowest loss a model
blind to earlier segments can reach). A vision-language model (qwen3_5)
trains on text, or on images through a segment-aware scatter (:mod:`.vision_language`).
"""

import dataclasses
import functools
import os
from dataclasses import dataclass, field

from torchtitan.tools import utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_seq1f1b.integration.context_parallel import whole_sequences
from torchtitan_seq1f1b.integration.metrics import Seq1F1BFigures
from torchtitan_seq1f1b.integration.summary import JobFacts, run_summary
from torchtitan_seq1f1b.integration.titan_0_3.attention import parallelize_with_document_ids
from torchtitan_seq1f1b.integration.titan_0_3.checkpointing import saving_attention
from torchtitan_seq1f1b.integration.titan_0_3.config_checks import check_config
from torchtitan_seq1f1b.integration.titan_0_3.job_data import (
    dataset_name_and_path,
    use_image_data,
    use_recall_data,
)
from torchtitan_seq1f1b.integration.titan_0_3.options import Seq1F1BSection
from torchtitan_seq1f1b.integration.titan_0_3.metrics import Seq1F1BMetricsProcessor
from torchtitan_seq1f1b.integration.titan_0_3.pipeline import pipeline_llm_seq1f1b
from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED, sequence_length
from torchtitan_seq1f1b.integration.titan_0_3.vision_attention import (
    with_dense_vision_attention,
)
from torchtitan_seq1f1b.integration.titan_0_3.vision_language import (
    image_index_kwargs,
    text_only_inputs,
)
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["Seq1F1BTrainer"]


class Seq1F1BTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        seq1f1b: Seq1F1BSection = field(default_factory=Seq1F1BSection)
        """Seq1F1B's options; every one is a flag (``--seq1f1b.num_segments 2``)."""

    # The first step this process trains (None until it trains one).
    _first_step: int | None = None

    def __init__(self, config: Config):
        if config.seq1f1b.data == "recall":
            use_recall_data(config)
        elif config.seq1f1b.data == "images":
            use_image_data(config)
        check_config(config)
        config.activation_checkpoint = saving_attention(config.activation_checkpoint)
        spec = config.model_spec
        options = config.seq1f1b
        parallelize_fn = text_only_inputs(spec.parallelize_fn)
        if utils.device_type == "cpu":
            parallelize_fn = with_dense_vision_attention(
                parallelize_with_document_ids(parallelize_fn, options.attention_backend)
            )
        config.model_spec = dataclasses.replace(
            spec,
            pipelining_fn=functools.partial(pipeline_llm_seq1f1b, options=options),
            parallelize_fn=parallelize_fn,
        )
        super().__init__(config)
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, ScheduleSeq1F1B) and isinstance(
            self.metrics_processor, Seq1F1BMetricsProcessor
        ):
            self.metrics_processor.figures = Seq1F1BFigures(schedule)

    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, except that a Seq1F1B schedule gets whole sequences under CP (it
        cuts each segment over the CP ranks; each rank counts its share of tokens) and,
        with images, each image token's feature row (``image_index``), to cut."""
        if not isinstance(getattr(self, "pp_schedule", None), ScheduleSeq1F1B):
            return super().post_dataloading_process(input_dict, labels)
        cp = self.parallel_dims.cp
        with whole_sequences(self.parallel_dims):
            inputs, labels, kwargs = super().post_dataloading_process(input_dict, labels)
        self.ntokens_seen -= labels.numel() - labels.numel() // cp
        return inputs, labels, image_index_kwargs(inputs, kwargs)

    def train_step(self, data_iterator) -> None:
        if self._first_step is None:
            self._first_step = self.step
        super().train_step(data_iterator)

    def train(self) -> None:
        """Train; then, on a Seq1F1B job's ranks holding the loss, log the run summary."""
        super().train()
        metrics = self.metrics_processor
        if getattr(metrics, "figures", None) is None or not self.pp_has_last_stage:
            return
        config = self.config
        dataset, dataset_path = dataset_name_and_path(config.dataloader)
        job = JobFacts(
            dataset=dataset,
            dataset_path=dataset_path,
            seq_len=sequence_length(config.training),
            shifted_per_document=FOLDED,
            steps=config.training.steps,
            checkpoint_folder=os.path.join(config.dump_folder, config.checkpoint.folder),
        )
        for line in run_summary(
            job, metrics.figures.schedule, self._first_step, self.step, metrics.recent_losses
        ):
            logger.info(line)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Hooks into torchtitan's ``Trainer``: the loss normaliser, CP inputs and the console.

The trainer counts the valid tokens of the whole step (all gradient
accumulation microbatches, summed over data-parallel ranks) and divides the
non-pipelined loss by that count, but hands pipeline schedules nothing: with
PP, torchtitan 0.2.2 back-propagates un-normalised token sums. Seq1F1B takes
the same count as its ``loss_normalizer``, so its gradients equal the
non-pipelined run's. Under context parallelism a Seq1F1B schedule gets whole
sequences from ``post_dataloading_process`` and cuts them per segment.

For Seq1F1B jobs the rank that holds the loss prints it (see
:class:`Seq1F1BMetricsProcessor`), so torchtitan's advice to add that rank to
``LOG_RANK`` in ``run_train.sh`` is left out, and at the end of ``train`` that
rank logs a summary (:func:`run_summary`).
"""

import functools
import importlib
import sys
from types import ModuleType

from torchtitan.tools.logging import logger

from torchtitan_seq1f1b.integration.context_parallel import whole_sequences
from torchtitan_seq1f1b.integration.titan_0_2.metrics import Seq1F1BMetricsProcessor
from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.integration.titan_0_2.summary import run_summary
from torchtitan_seq1f1b.schedules import ScheduleSeq1F1B

__all__ = ["install_trainer_hook"]


def _running_trainer_module() -> ModuleType:
    """The module whose Trainer class this process instantiates.

    Run as ``-m torchtitan.train``, the trainer module executes as
    ``__main__``, a module object distinct from ``torchtitan.train``.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train":
        return main
    return importlib.import_module("torchtitan.train")


def _hook_forward_backward_step(forward_backward_step):
    @functools.wraps(forward_backward_step)
    def hooked(self, *, input_dict, labels, global_valid_tokens):
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, ScheduleSeq1F1B):
            schedule.loss_normalizer = global_valid_tokens
            if isinstance(self.metrics_processor, Seq1F1BMetricsProcessor):
                self.metrics_processor.schedule = schedule
            if not hasattr(self, "_seq1f1b_first_step"):
                self._seq1f1b_first_step = self.step
        return forward_backward_step(
            self,
            input_dict=input_dict,
            labels=labels,
            global_valid_tokens=global_valid_tokens,
        )

    return hooked


def _hook_post_dataloading_process(post_dataloading_process):
    @functools.wraps(post_dataloading_process)
    def hooked(self, *args, **kwargs):
        if not isinstance(getattr(self, "pp_schedule", None), ScheduleSeq1F1B):
            return post_dataloading_process(self, *args, **kwargs)
        # Under CP the schedule cuts every segment over the CP ranks itself.
        with whole_sequences(self.parallel_dims):
            return post_dataloading_process(self, *args, **kwargs)

    return hooked


def _hook_train(train):
    @functools.wraps(train)
    def hooked(self):
        train(self)
        metrics = self.metrics_processor
        if (
            self.parallel_dims.pp_enabled
            and self.job_config.parallelism.pipeline_parallel_schedule in SCHEDULES
            and isinstance(metrics, Seq1F1BMetricsProcessor)
            and metrics.prints_loss
        ):
            first_step = getattr(self, "_seq1f1b_first_step", None)
            for line in run_summary(
                self.job_config, metrics.schedule, first_step, self.step, metrics.recent_losses
            ):
                logger.info(line)

    return hooked


def _hook_loss_visibility_warning(ensure_pp_loss_visible):
    @functools.wraps(ensure_pp_loss_visible)
    def hooked(parallel_dims, job_config, color):
        if job_config.parallelism.pipeline_parallel_schedule not in SCHEDULES:
            ensure_pp_loss_visible(parallel_dims, job_config, color)

    return hooked


def install_trainer_hook() -> None:
    """Idempotent: hook the running trainer module's ``Trainer`` and loss warning."""
    module = _running_trainer_module()
    if getattr(module.Trainer.train, "_seq1f1b", False):
        return
    for owner, name, hook in (
        (module.Trainer, "forward_backward_step", _hook_forward_backward_step),
        (module.Trainer, "post_dataloading_process", _hook_post_dataloading_process),
        (module.Trainer, "train", _hook_train),
        (module, "ensure_pp_loss_visible", _hook_loss_visibility_warning),
    ):
        hooked = hook(getattr(owner, name))
        hooked._seq1f1b = True
        setattr(owner, name, hooked)

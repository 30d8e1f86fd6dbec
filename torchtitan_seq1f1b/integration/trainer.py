# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The one hook into torchtitan's ``Trainer``: the loss normaliser.

The trainer counts the valid tokens of the whole step (all gradient
accumulation microbatches, summed over data-parallel ranks) and divides the
non-pipelined loss by that count, but hands pipeline schedules nothing: with
PP, torchtitan 0.2.2 back-propagates un-normalised token sums. Seq1F1B takes
the same count as its ``loss_normalizer``, so its gradients equal the
non-pipelined run's.
"""

import functools
import importlib
import sys

from torchtitan_seq1f1b.integration.metrics import Seq1F1BMetricsProcessor
from torchtitan_seq1f1b.schedule import ScheduleSeq1F1B

__all__ = ["install_trainer_hook"]


def _running_trainer_class() -> type:
    """The Trainer class this process instantiates.

    Run as ``-m torchtitan.train``, the trainer module executes as
    ``__main__``, a module object distinct from ``torchtitan.train``.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train":
        return main.Trainer
    return importlib.import_module("torchtitan.train").Trainer


def install_trainer_hook() -> None:
    trainer_class = _running_trainer_class()
    forward_backward_step = trainer_class.forward_backward_step
    if getattr(forward_backward_step, "_seq1f1b", False):
        return

    @functools.wraps(forward_backward_step)
    def hooked(self, *, input_dict, labels, global_valid_tokens):
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, ScheduleSeq1F1B):
            schedule.loss_normalizer = global_valid_tokens
            if isinstance(self.metrics_processor, Seq1F1BMetricsProcessor):
                self.metrics_processor.schedule = schedule
        return forward_backward_step(
            self,
            input_dict=input_dict,
            labels=labels,
            global_valid_tokens=global_valid_tokens,
        )

    hooked._seq1f1b = True
    trainer_class.forward_backward_step = hooked

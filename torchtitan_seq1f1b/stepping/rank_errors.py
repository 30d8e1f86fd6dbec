# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Raising one rank's input error on every rank of the pipeline, without a
collective in a steady-state step.

Only the first stage sees inputs and only the last sees targets; a rank that
raised alone at the first step would leave the others waiting for
activations that never come. So the first ``step()`` and the first
``eval()`` share every rank's verdict in one collective, which every rank
reaches whatever its inputs. Later calls decide from what each rank already
knows: the document ids go to every rank, so an error in them is raised by
every rank alike; an input only this rank holds must keep the shapes it had
at its first call (the stages' buffers are sized then; inputs every segment
takes whole, such as a VLM's images, keep their dtype and rank), and this rank
raises if it does not: torchrun then stops the job.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_seq1f1b.stepping.microbatch_inputs import MicrobatchInputs

__all__ = ["InputCheck"]

Signature = tuple


def input_signature(
    inputs: MicrobatchInputs, whole_kwargs: frozenset[str] = frozenset()
) -> Signature:
    """Shapes and dtypes of every tensor this rank passed, per microbatch; of the
    ``whole_kwargs`` (a VLM's images, a number per microbatch) dtypes and ranks only:
    every unit takes them uncut, so they size no buffer."""

    def of(value, whole: bool = False):
        if isinstance(value, torch.Tensor):
            return (value.dim() if whole else tuple(value.shape)), value.dtype
        if isinstance(value, (tuple, list)):
            return tuple(of(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, of(v, k in whole_kwargs)) for k, v in sorted(value.items()))
        return type(value).__name__

    return of((inputs.args, inputs.kwargs, inputs.targets, inputs.document_ids))


@dataclass
class InputCheck:
    """Raises a step's input error on the ranks that must know it (see the module)."""

    schedule: str
    whole_kwargs: frozenset[str] = frozenset()
    _checked: dict[bool, Signature] = field(default_factory=dict)

    def __call__(
        self, stage: _PipelineStageBase, has_backward: bool, inputs: MicrobatchInputs | str
    ) -> None:
        error = inputs if isinstance(inputs, str) else None
        signature = None if error else input_signature(inputs, self.whole_kwargs)
        name = f"{self.schedule}.{'step' if has_backward else 'eval'}"
        if has_backward not in self._checked:
            has_ids = error is None and inputs.document_ids is not None
            self._share(stage, name, error, has_ids)
            self._checked[has_backward] = signature
            return
        checked = self._checked[has_backward]
        if error is None and signature != checked:
            error = (
                f"{_first_change(signature, checked)} (shape, dtype per microbatch); the "
                "pipeline's buffers are sized at the first call, so later calls pass the "
                "same shapes"
            )
        if error is not None:
            raise ValueError(f"{name}: pipeline rank {dist.get_rank(stage.group)}: {error}")

    @staticmethod
    def _share(stage: _PipelineStageBase, name: str, error: str | None, has_ids: bool) -> None:
        """Raise on every rank if any rank has an error, or if document ids
        reached some ranks but not all."""
        flags = torch.tensor([error is not None, has_ids], dtype=torch.int32, device=stage.device)
        dist.all_reduce(flags, group=stage.group)
        errors_seen, ranks_with_ids = flags.tolist()
        world = dist.get_world_size(stage.group)
        if errors_seen:
            errors: list = [None] * world
            dist.all_gather_object(errors, error, group=stage.group)
            rank, message = next((r, e) for r, e in enumerate(errors) if e is not None)
            raise ValueError(f"{name}: pipeline rank {rank}: {message}")
        if ranks_with_ids not in (0, world):
            raise ValueError(
                f"{name}: document ids reached {ranks_with_ids} of {world} pipeline "
                "ranks; pass them to every rank's step() and eval(), since every stage's "
                "attention needs them"
            )


def _first_change(new: Signature, old: Signature) -> str:
    """The first of (inputs, keyword inputs, targets, document ids) whose shapes changed."""
    names = ("inputs", "keyword inputs", "targets", "document ids")
    name, now, before = next((n, a, b) for n, a, b in zip(names, new, old) if a != b)
    return f"{name} are {now}, at the first call {before}"

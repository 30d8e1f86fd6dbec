# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A step's inputs as real microbatches, whole-batch or pre-split.

``step()`` and ``eval()`` take either whole batches (``*args``, ``target=``,
``**kwargs``), split along the batch dim as torch's schedules split them, or
microbatches the caller already split (``arg_mbs``, ``kwarg_mbs``,
``target_mbs``, one entry per microbatch, as torch 2.14+ and torchtitan 0.3's
trainer pass them). Packed-document ids come as a keyword of either form and
are taken out here: the model never receives them.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks, TensorChunkSpec

from torchtitan_seq1f1b.documents import check_document_ids, read_document_starts
from torchtitan_seq1f1b.stepping.segment_inputs import SegmentSplitter

__all__ = ["MicrobatchInputs", "split_microbatches"]


@dataclass
class MicrobatchInputs:
    """One entry per real microbatch; ``targets``/``document_ids`` None when not given.

    ``document_ids[i]`` is (microbatch_size, seq_len); ``document_starts[i]``
    holds, per row, the positions where its documents start (host ints).
    """

    args: list[tuple]
    kwargs: list[dict]
    targets: list[torch.Tensor] | None
    document_ids: list[torch.Tensor] | None
    document_starts: list[list[tuple[int, ...]]] | None = None


def split_microbatches(
    splitter: SegmentSplitter,
    n_microbatches: int,
    args: tuple,
    kwargs: dict,
    target: Any,
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
    chunk_specs: tuple[tuple[TensorChunkSpec, ...] | None, dict[str, TensorChunkSpec] | None],
    document_ids_kwarg: str | None,
) -> MicrobatchInputs | str:
    """The step's microbatches, or why the inputs do not form ``n_microbatches`` of them.

    Every check depends on this rank's inputs only, so a schedule can share
    the verdict across ranks before its first pipeline message.
    """
    if all(mbs is None for mbs in (arg_mbs, kwarg_mbs, target_mbs)):
        return _split_whole_batch(
            splitter, n_microbatches, args, kwargs, target, chunk_specs, document_ids_kwarg
        )
    mixed = [
        name
        for name, given in (
            ("positional inputs", bool(args)),
            ("keyword inputs", bool(kwargs)),
            ("target", target is not None),
        )
        if given
    ]
    if mixed:
        return (
            f"{' and '.join(mixed)} passed together with pre-split arg_mbs/kwarg_mbs/"
            "target_mbs; pass every input of a step in one form"
        )
    args_mbs = [()] * n_microbatches if arg_mbs is None else arg_mbs
    kwargs_mbs = [{}] * n_microbatches if kwarg_mbs is None else kwarg_mbs
    for name, mbs, kind in (
        ("arg_mbs", args_mbs, tuple),
        ("kwarg_mbs", kwargs_mbs, dict),
        ("target_mbs", target_mbs, None),
    ):
        if mbs is None:
            continue
        if not isinstance(mbs, list) or len(mbs) != n_microbatches:
            count = len(mbs) if isinstance(mbs, list) else type(mbs).__name__
            return f"{name} must be a list of {n_microbatches} microbatches; got {count}"
        if kind is not None and not all(isinstance(mb, kind) for mb in mbs):
            return f"every entry of {name} must be a {kind.__name__}"
    ids = None
    if document_ids_kwarg and any(document_ids_kwarg in mb for mb in kwargs_mbs):
        ids = [mb.get(document_ids_kwarg) for mb in kwargs_mbs]
        kwargs_mbs = [
            {k: v for k, v in mb.items() if k != document_ids_kwarg} for mb in kwargs_mbs
        ]
    for i in range(n_microbatches):
        target_i = None if target_mbs is None else target_mbs[i]
        error = splitter.input_error(args_mbs[i], target_i) or (
            None
            if ids is None
            else _document_ids_error(
                document_ids_kwarg, ids[i], (*args_mbs[i], target_i), splitter, 1
            )
        )
        if error is not None:
            return f"microbatch {i}: {error}"
    return _with_document_starts(
        MicrobatchInputs(list(args_mbs), list(kwargs_mbs), target_mbs, ids), document_ids_kwarg
    )


def _split_whole_batch(
    splitter, n_microbatches, args, kwargs, target, chunk_specs, document_ids_kwarg
) -> MicrobatchInputs | str:
    kwargs = dict(kwargs)
    ids = kwargs.pop(document_ids_kwarg, None) if document_ids_kwarg else None
    error = splitter.input_error(args, target) or (
        None
        if ids is None
        else _document_ids_error(
            document_ids_kwarg, ids, (*args, target), splitter, n_microbatches
        )
    )
    if error is not None:
        return error
    args_mbs, kwargs_mbs = (
        split_args_kwargs_into_chunks(args, kwargs, n_microbatches, *chunk_specs)
        if args or kwargs
        else ([()] * n_microbatches, [{}] * n_microbatches)
    )
    inputs = MicrobatchInputs(
        args_mbs,
        kwargs_mbs,
        None if target is None else _split_rows(target, n_microbatches),
        None if ids is None else _split_rows(ids, n_microbatches),
    )
    return _with_document_starts(inputs, document_ids_kwarg)


def _with_document_starts(inputs: MicrobatchInputs, name: str | None) -> MicrobatchInputs | str:
    """``inputs`` with where their documents start, read once for the step."""
    if inputs.document_ids is None:
        return inputs
    starts = read_document_starts(inputs.document_ids)
    if isinstance(starts, str):
        return f"{name}: {starts}"
    inputs.document_starts = starts
    return inputs


def _document_ids_error(
    name: str, ids: Any, tensors: tuple, splitter: SegmentSplitter, min_rows: int
) -> str | None:
    """Why ``ids`` do not fit the samples in ``tensors``, if they do not."""
    batch = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else -1
    error = check_document_ids(ids, batch, splitter.plan.seq_len)
    if error is None:
        # With seq_dim 0 a microbatch is one unbatched (packed) row.
        rows = [
            t.shape[0] if splitter.seq_dim else 1 for t in tensors if isinstance(t, torch.Tensor)
        ]
        if any(r != batch for r in rows):
            error = (
                f"document ids have {batch} rows but the inputs/targets have "
                f"{rows}; pass one row of ids per sample"
            )
        elif batch < min_rows:
            error = f"{batch} rows cannot fill {min_rows} microbatches"
    return None if error is None else f"{name}: {error}"


def _split_rows(tensor: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    chunks, _ = split_args_kwargs_into_chunks((tensor,), None, n_microbatches)
    return [chunk[0] for chunk in chunks]

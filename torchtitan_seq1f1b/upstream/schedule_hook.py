# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The torchtitan core patch: a schedule-builder hook in ``pipeline_llm``.

``pipeline_llm`` splits the model, parallelizes every part and then always
builds torch's schedule (``_build_pipeline_schedule``), so an out-of-tree
schedule must copy the split-and-parallelize loop. The hook is one
keyword-only argument, ``schedule_builder``: called, when set, with the
keyword arguments ``_build_pipeline_schedule`` gets in that tree (0.3 passes
``local_batch_size``, main ``num_microbatches``), it returns the schedule.
Unset, the function runs as before. ``pipeline_vlm`` passes it through with
its other keyword arguments.
"""

from torchtitan_seq1f1b.upstream.tree import SourceTree, UpstreamError

__all__ = [
    "HOOK_TEST",
    "PIPELINE_PARALLEL",
    "add_schedule_builder",
    "has_schedule_builder",
    "hook_edits",
]

PIPELINE_PARALLEL = "torchtitan/distributed/pipeline_parallel.py"
HOOK_TEST = "tests/unit_tests/test_pipeline_schedule_builder.py"
PARAMETER = "schedule_builder"
SIGNATURE_ANCHOR = "    loss_fn: LossFunction,\n"
CALL_ANCHOR = "pp_schedule = _build_pipeline_schedule("
PARAMETER_LINES = (
    "    # Builds the schedule instead of _build_pipeline_schedule, from its arguments.\n"
    "    schedule_builder: Callable[..., _PipelineSchedule] | None = None,\n"
)
HOOKED_CALL = "pp_schedule = (schedule_builder or _build_pipeline_schedule)("


def _pipeline_llm(text: str, where: str) -> tuple[int, int]:
    """(start, end) of ``def pipeline_llm`` in ``text``: up to the next top-level def."""
    start = text.find("\ndef pipeline_llm(")
    if start < 0:
        raise UpstreamError(f"{where}: no `def pipeline_llm(` to add the schedule hook to")
    end = text.find("\ndef ", start + 1)
    return start, len(text) if end < 0 else end


def has_schedule_builder(text: str) -> bool:
    """Whether ``pipeline_parallel.py``'s ``pipeline_llm`` takes the hook already."""
    start, end = _pipeline_llm(text, PIPELINE_PARALLEL)
    return f"    {PARAMETER}:" in text[start:end]


def add_schedule_builder(text: str, where: str) -> str:
    """``pipeline_parallel.py`` with the hook: the parameter after ``loss_fn`` and the
    schedule built by it when set. :class:`UpstreamError` names a missing anchor."""
    start, end = _pipeline_llm(text, where)
    function = text[start:end]
    for anchor in (SIGNATURE_ANCHOR, CALL_ANCHOR):
        if function.count(anchor) != 1:
            raise UpstreamError(
                f"{where}: pipeline_llm has {function.count(anchor)} of {anchor.strip()!r} "
                "(one expected) to add the schedule hook at"
            )
    function = function.replace(SIGNATURE_ANCHOR, SIGNATURE_ANCHOR + PARAMETER_LINES)
    function = function.replace(CALL_ANCHOR, HOOKED_CALL)
    return text[:start] + function + text[end:]


def hook_edits(source: SourceTree) -> dict[str, str | None]:
    """path -> the tree's text (None: a new file) for every file the hook patch touches;
    empty if the tree has the hook already."""
    if has_schedule_builder(source.read(PIPELINE_PARALLEL)):
        return {}
    return {PIPELINE_PARALLEL: source.read(PIPELINE_PARALLEL), HOOK_TEST: None}

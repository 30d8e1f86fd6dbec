# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Config problems every adapter checks alike, on fields torchtitan 0.2.2 and 0.3 share.

``parallelism.pipeline_parallel_schedule_csv``, ``compile.enable`` /
``compile.components`` and ``seq1f1b.num_segments`` have the same names and
meaning in both releases; only how a user sets them differs (a TOML key or a
flag), which ``compile_fix`` words.
"""

from typing import Any

__all__ = ["shared_problems"]


def shared_problems(
    parallelism: Any,
    compile_config: Any,
    num_segments: int | str,
    schedule: str,
    split_backward: bool,
    compile_fix: str,
) -> list[str]:
    """What a Seq1F1B job cannot run in these fields, one message per problem.

    ``schedule`` names the Seq1F1B schedule, ``split_backward`` says whether it
    splits backwards into input and weight steps.
    """
    problems = []
    if parallelism.pipeline_parallel_schedule_csv:
        problems.append(
            "parallelism.pipeline_parallel_schedule_csv is set; Seq1F1B generates its "
            "own order, so leave it empty"
        )
    if compile_config.enable and split_backward:
        problems.append(
            f"compile.enable cannot run under {schedule}: torch's compiled backward "
            "donates its buffers and then refuses the retain_graph backward that the "
            "input-gradient step of a split backward runs (pytorch/pytorch#161904, "
            f"pytorch/torchtitan#3584); {compile_fix}"
        )
    if num_segments != "auto" and not (isinstance(num_segments, int) and num_segments >= 1):
        problems.append(
            f"seq1f1b.num_segments={num_segments!r} must be an integer >= 1 or 'auto'"
        )
    return problems

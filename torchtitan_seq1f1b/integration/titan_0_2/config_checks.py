# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Clear errors for config mistakes that torchtitan 0.2.2 reports vaguely.

torchtitan imports ``[job] custom_config_module`` (this package) from inside
``ConfigManager.parse_args``, after reading the TOML file and before turning
it into a ``JobConfig``. :func:`install_config_checks` wraps two later steps
of that parse, so the checks run on every rank before any process group
exists:

- a ``[seq1f1b]`` key that is not an option (``num_segment``), or a section
  name close to ``seq1f1b``, gets the valid keys and the closest one instead of
  torchtitan's "Invalid field names ... run_train.sh --help";
- a ``pipeline_parallel_schedule`` that neither this package nor torch knows
  (``"Seq1F1b"``) gets the closest of both lists instead of torch's list,
  which lacks the Seq1F1B names.

Both exit as command-line usage errors do (tyro's, for a misspelt
``--seq1f1b.*`` flag): status 1, one message, no traceback, printed by local
rank 0 only so that it appears once per node.
"""

import difflib
import functools
import os
from dataclasses import fields, is_dataclass

import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.config import ConfigManager

from torchtitan_seq1f1b.integration.schedules import SCHEDULES
from torchtitan_seq1f1b.integration.options import Seq1F1BOptions

__all__ = [
    "Seq1F1BUsageError",
    "install_config_checks",
    "schedule_name_problem",
    "seq1f1b_section_problem",
]

SECTION = "seq1f1b"


class Seq1F1BUsageError(SystemExit):
    """A job config mistake found while torchtitan parses it; exits with status 1.

    ``message`` holds the text; only local rank 0 prints it.
    """

    def __init__(self, message: str):
        self.message = message
        prints = os.environ.get("LOCAL_RANK", "0") == "0"
        super().__init__(f"torchtitan_seq1f1b: error: {message}" if prints else 1)


def _closest(name: str, choices: list[str]) -> str | None:
    """The choice nearest to ``name``, ignoring case, if any is near."""
    by_lower = {choice.lower(): choice for choice in choices}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def _did_you_mean(closest: str | None) -> str:
    return f"did you mean {closest!r}? " if closest else ""


@functools.cache
def torch_schedule_names() -> tuple[str, ...]:
    """The names torch's ``get_schedule_class`` accepts, read off its public classes."""
    names = []
    for public in pipelining.__all__:
        name = public.removeprefix("Schedule")
        try:
            get_schedule_class(name)
        except ValueError:
            continue
        names.append(name)
    return tuple(names)


def schedule_name_problem(name: str) -> str | None:
    """What is wrong with ``pipeline_parallel_schedule = name``, or None.

    The Seq1F1B names must match exactly; torch's are case-insensitive.
    """
    if name in SCHEDULES:
        return None
    try:
        get_schedule_class(name)
        return None
    except ValueError:
        pass
    ours, torchs = list(SCHEDULES), list(torch_schedule_names())
    return (
        f"parallelism.pipeline_parallel_schedule = {name!r} is not a schedule; "
        f"{_did_you_mean(_closest(name, ours + torchs))}"
        f"Seq1F1B schedules (exact case): {', '.join(ours)}; "
        f"torch's: {', '.join(torchs)}"
    )


def seq1f1b_section_problem(toml_values: dict, sections: set[str]) -> str | None:
    """What is wrong with the ``[seq1f1b]`` table of a parsed TOML file, or None.

    ``sections`` are the job config's section names; an unknown one close to
    ``seq1f1b`` (``[seq1f1]``) is caught too.
    """
    keys = [f.name for f in fields(Seq1F1BOptions)]
    for section in toml_values:
        if section not in sections and _closest(section, [SECTION]):
            return f"[{section}] is not a section; did you mean [{SECTION}]?"
    table = toml_values.get(SECTION)
    if not isinstance(table, dict):
        return None
    unknown = [key for key in table if key not in keys]
    if not unknown:
        return None
    key = unknown[0]
    return (
        f"[{SECTION}] {key} is not an option; {_did_you_mean(_closest(key, keys))}"
        f"[{SECTION}] takes: {', '.join(keys)}"
    )


def _check_toml(dict_to_dataclass):
    @functools.wraps(dict_to_dataclass)
    def checked(self, cls, data):
        sections = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
        if SECTION in sections:
            problem = seq1f1b_section_problem(data, sections)
            if problem:
                raise Seq1F1BUsageError(problem)
        return dict_to_dataclass(self, cls, data)

    checked._seq1f1b = True
    return checked


def _check_parsed(validate_config):
    @functools.wraps(validate_config)
    def checked(self):
        validate_config(self)
        config = self.config
        parallelism = config.parallelism
        if (
            hasattr(config, SECTION)
            and parallelism.pipeline_parallel_degree > 1
            and not parallelism.pipeline_parallel_schedule_csv
        ):
            problem = schedule_name_problem(parallelism.pipeline_parallel_schedule)
            if problem:
                raise Seq1F1BUsageError(problem)

    checked._seq1f1b = True
    return checked


def install_config_checks() -> None:
    """Idempotent: wrap ``ConfigManager``'s TOML conversion and final validation."""
    if not getattr(ConfigManager._dict_to_dataclass, "_seq1f1b", False):
        ConfigManager._dict_to_dataclass = _check_toml(ConfigManager._dict_to_dataclass)
    if not getattr(ConfigManager._validate_config, "_seq1f1b", False):
        ConfigManager._validate_config = _check_parsed(ConfigManager._validate_config)

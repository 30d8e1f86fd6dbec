# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan glue: one adapter per torchtitan release, sharing the ``[seq1f1b]`` options.

- :mod:`.options`: the ``[seq1f1b]`` options, one dataclass for every adapter;
- :mod:`.schedules`: the Seq1F1B schedule names a job selects;
- :mod:`.plan`: the segment plan the options ask for;
- :mod:`.document_masks`: torchtitan's ``attention_masks`` as document ids;
- :mod:`.metrics`, :mod:`.summary`: the figures a job logs and its closing lines;
- :mod:`.cpu`: torchtitan on a machine without an accelerator;
- :mod:`.titan_0_2`: the torchtitan 0.2.2 adapter (TOML configs,
  ``custom_config_module``, train-spec and trainer hooks);
- :mod:`.titan_0_3`: the torchtitan 0.3 adapter (config registry, Trainer
  subclass, keyword-only pipelining function).

The package's ``__init__`` calls :func:`install` when it is imported inside a
torchtitan process; nothing here imports torchtitan before that.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

__all__ = ["install", "titan_release"]

ADAPTERS = {
    "0.2": "torchtitan_seq1f1b.integration.titan_0_2",
    "0.3": "torchtitan_seq1f1b.integration.titan_0_3",
}


def titan_release() -> str | None:
    """The installed torchtitan's "major.minor", None without torchtitan."""
    try:
        return ".".join(version("torchtitan").split(".")[:2])
    except PackageNotFoundError:
        return None


def install() -> None:
    """Hook Seq1F1B into the running torchtitan through the adapter for its release."""
    release = titan_release()
    if release not in ADAPTERS:
        raise RuntimeError(
            f"torchtitan_seq1f1b has adapters for torchtitan {sorted(ADAPTERS)} but "
            f"torchtitan {version('torchtitan')} is installed; install a supported release "
            "(pip install 'torchtitan==0.2.2' or 'torchtitan==0.3.0')"
        )
    import_module(ADAPTERS[release]).install()

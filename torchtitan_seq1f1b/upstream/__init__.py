# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Seq1F1B as a torchtitan experiment: the patch for an upstream PR.

``python -m torchtitan_seq1f1b.upstream --torchtitan-src DIR`` writes a
``git apply``-able diff that adds ``torchtitan/experiments/seq1f1b/`` to a
torchtitan 0.3.x source tree (see ``docs/upstream.md``):

- :mod:`.tree`: the source tree and :class:`UpstreamError`;
- :mod:`.experiment_files`: the experiment's files, from the torchtitan 0.3
  adapter and the README and tests in ``experiment/``;
- :mod:`.registration`: the experiment's entries in torchtitan's
  ``experiments/__init__.py`` and ``experiments/README.md``;
- :mod:`.formatting`: with ``--ufmt``, the new Python files formatted as
  torchtitan's pre-commit formats them;
- :mod:`.patch`: all of it as one diff.

A tool: training processes never import it.
"""

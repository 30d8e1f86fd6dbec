# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Tools apart from training: the simulator, the CPU benchmark, charts and model shapes.

A training process never imports this package; the commands users type stay
``python -m torchtitan_seq1f1b.simulate``, ``.bench`` and ``.plot``.
"""

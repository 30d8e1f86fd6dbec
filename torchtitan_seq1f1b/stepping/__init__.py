# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""What a Seq1F1B schedule's ``step()`` does around torch's runtime (:mod:`torchtitan_seq1f1b.schedules`).

- :mod:`.microbatch_inputs`: splits a step's inputs into microbatches.
- :mod:`.segment_inputs`: cuts them into units and merges units' outputs.
- :mod:`.unit_compute`: surrounds every compute call of a unit.
- :mod:`.receives`: places receives ahead of the computes that need them.
- :mod:`.parameter_grads`: keeps parameter gradients across torch's metadata inference.
- :mod:`.stage_layout`: checks stages, their placement and the segment plan.
- :mod:`.rank_errors`: raises an input error on every rank that must know it.
"""

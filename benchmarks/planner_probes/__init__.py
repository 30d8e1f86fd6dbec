# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Planner probes for pipeline ranks that share one host's CPU cores (the CPU benchmark's).

- :mod:`.pipeline_units`: units timed inside short pipeline steps on local
  ranks, with the compute-call recorder of :mod:`.compute_spans`;
- :mod:`.runtime_overhead`: what the pipeline runtime costs per action around
  the units, probed through it on two local ranks (both build a rank's pipeline
  with :mod:`.probe_pipeline`);
- :mod:`.host_probes`: both as the calibration's
  :class:`~torchtitan_seq1f1b.planner.calibrate.HostProbes`.
"""

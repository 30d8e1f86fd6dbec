# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Attention kernels on private aten ops, one module per kernel.

Each computes causal attention of a segment's queries against its prefix with
the mask aligned bottom-right, and none materialises or saves an (Lq, Lk)
mask. The private ops they call are used nowhere else in the package.

- :mod:`.cpu_flash`: torch's CPU flash kernel with a mask rebuilt in backward.
- :mod:`.cuda_mem_efficient`: torch's CUDA memory-efficient kernel with its
  built-in bottom-right causal mask (any dtype but float64, sm50+).
- :mod:`.cuda_flash`: torch's CUDA flash kernel, dense, bottom-right causal
  (fp16/bf16, sm80+).
"""

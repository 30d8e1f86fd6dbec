# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A negative control: Seq1F1B jobs whose image tokens take the feature rows counted
within their own segment, as if the trainer computed no whole-sequence ``image_index``.

``python -m tests.integration.titan_0_3.segment_local_images MODULE ARGS...`` runs
MODULE as ``__main__`` (under torchrun, the next launcher or torchtitan.train).
"""

from tests.launch import run_next_module

if __name__ == "__main__":
    from torchtitan_seq1f1b.integration.titan_0_3 import trainer

    trainer.image_index_kwargs = lambda tokens, kwargs: kwargs
    run_next_module()

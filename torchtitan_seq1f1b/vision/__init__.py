# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Vision-language models' image features under Seq1F1B: encoded once per microbatch,
scattered segment by segment, the encoder backpropagated once (docs/vision-language.md)."""

from torchtitan_seq1f1b.vision.features import ImageFeatures, image_feature_index
from torchtitan_seq1f1b.vision.scatter import SegmentAwareImageScatter

__all__ = ["ImageFeatures", "SegmentAwareImageScatter", "image_feature_index"]

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The named model shapes and their parameter counts."""

from torchtitan_seq1f1b.tools.model_shapes import embedding_params, layer_params, MODEL_PRESETS


def test_presets_have_the_expected_sizes():
    expected = {
        "paper-2.7b": (2.5, 3.0), "paper-7b": (6.5, 7.2), "paper-13b": (12.5, 13.5),
        "paper-30b": (29, 31), "llama3-8b": (7.8, 8.2), "llama3-70b": (69, 72),
    }
    assert expected.keys() == MODEL_PRESETS.keys()
    for name, (low, high) in expected.items():
        shape = MODEL_PRESETS[name]
        total = (shape.n_layers * layer_params(shape, 1) + 2 * embedding_params(shape, 1)) / 1e9
        assert low < total < high, name

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``install()`` refuses a torchtitan adapter on a torch older than it was tested on,
before it imports torchtitan, naming both versions and the install that fixes it."""

import pytest

from torchtitan_seq1f1b import integration


@pytest.mark.parametrize(
    "release,torch_release,oldest", [("0.2", (2, 12), "2.13"), ("0.3", (2, 13), "2.14")]
)
def test_an_adapter_refuses_an_older_torch(monkeypatch, release, torch_release, oldest):
    monkeypatch.setattr(integration, "titan_release", lambda: release)
    monkeypatch.setattr(integration, "TORCH_RELEASE", torch_release)
    monkeypatch.setattr(integration, "import_module", pytest.fail)
    expected = rf"torchtitan {release} adapter was tested on torch >= {oldest}.*torch=={oldest}\.\*"
    with pytest.raises(RuntimeError, match=expected):
        integration.install()

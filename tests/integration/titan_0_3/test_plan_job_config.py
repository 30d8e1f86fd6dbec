# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.plan --job-config`` under torchtitan 0.3, whose configs are Python."""

import pytest

from torchtitan_seq1f1b.tools.plan import cli

from tests.harness import REPO


def test_a_toml_job_config_is_refused_naming_the_release(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--job-config", str(REPO / "train_configs" / "debug_seq1f1b.toml")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--job-config reads torchtitan 0.2.2 TOML configs, and torchtitan 0.3" in error
    assert "give the model and layout options" in error

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A torchtitan job that a rank aborts only in teardown runs again, from its dump folder as it was."""

import subprocess

import pytest

from torchtitan_seq1f1b.check import titan_runs

TEARDOWN_ABORT = (
    "step:  6  loss:  5.8\nProcess group destroyed\n"
    "terminate called without an active exception\nFatal Python error: Aborted\n"
)


def _scripted(monkeypatch, outcomes: list[tuple[int, str]], dump_folder):
    """subprocess.run answers with ``outcomes`` in turn; each call writes a file."""
    calls = []

    def run(command, **kwargs):
        calls.append(sorted(p.name for p in dump_folder.iterdir()))
        (dump_folder / f"attempt{len(calls)}").write_text("")
        code, output = outcomes[len(calls) - 1]
        return subprocess.CompletedProcess(command, code, stdout=output)

    monkeypatch.setattr(titan_runs.subprocess, "run", run)
    return calls


def test_an_abort_in_teardown_runs_the_job_again_from_the_same_folder(monkeypatch, tmp_path):
    (tmp_path / "checkpoint").write_text("")
    calls = _scripted(monkeypatch, [(1, TEARDOWN_ABORT), (0, "trained")], tmp_path)
    run = titan_runs.torchrun(tmp_path, 2)
    assert run.output == "trained"
    assert calls == [["checkpoint"], ["checkpoint"]]  # the first attempt's files are gone


@pytest.mark.parametrize(
    "outcomes",
    [
        [(1, "Traceback: ValueError")],  # any other failure: at once
        [(1, TEARDOWN_ABORT), (1, TEARDOWN_ABORT)],  # only one more attempt
    ],
)
def test_other_failures_are_not_retried(monkeypatch, tmp_path, outcomes):
    calls = _scripted(monkeypatch, outcomes, tmp_path)
    with pytest.raises(titan_runs.RunFailed):
        titan_runs.torchrun(tmp_path, 2)
    assert len(calls) == len(outcomes)

# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A job's ranks forked from the job server start as torchrun starts them and train as they do under torchrun.

The tests' torchtitan jobs run there (tests/harness.py), so this is what
stands between them and ``torchrun``: the same losses and grad norms bit for
bit, the same rank environment, torchtitan and this package imported afresh by
every job, failing and hung jobs stopped as torchrun stops them.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.harness import JOB_SERVER, REPO, TEST_ARGS
from torchtitan_seq1f1b.check import titan_runs

RANKS = "tests.check.job_ranks"


def server_run(action, folder, env=None, timeout=120, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS="1") if env is None else env
    return JOB_SERVER.run([RANKS], [action, str(folder)], nproc, env, REPO, timeout)


def read_facts(folder, nproc=2):
    return [json.loads((folder / f"{rank}.json").read_text()) for rank in range(nproc)]


def test_a_job_trains_as_under_torchrun(tmp_path):
    args = (*TEST_ARGS, "--training.steps", "3")
    under_torchrun = titan_runs.torchrun(tmp_path / "torchrun", 2, *args)
    forked = titan_runs.torchrun(tmp_path / "forked", 2, *args, server=JOB_SERVER)
    assert len(forked.losses) == 3
    assert forked.losses == under_torchrun.losses
    assert forked.grad_norms == under_torchrun.grad_norms


def test_ranks_start_as_torchrun_starts_them(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", SEQ1F1B_JOB_FACT="from the job")
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "forked").mkdir()
    subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
            "-m", RANKS, "facts", str(tmp_path / "torchrun"),
        ],
        cwd=REPO, env=env, check=True, capture_output=True,
    )
    assert server_run("facts", tmp_path / "forked", env).returncode == 0
    torchrun_facts, forked_facts = read_facts(tmp_path / "torchrun"), read_facts(tmp_path / "forked")
    for rank, (expected, forked) in enumerate(zip(torchrun_facts, forked_facts)):
        assert forked["env"] == expected["env"] | {"MASTER_ADDR": "127.0.0.1"}
        assert forked["env"]["RANK"] == str(rank)
        assert forked["env"]["SEQ1F1B_JOB_FACT"] == "from the job"
        for fact in ("cwd", "path0", "has_port", "threads"):
            assert forked[fact] == expected[fact], fact
        assert expected["argv"] == ["facts", str(tmp_path / "torchrun")]
        assert forked["argv"] == ["facts", str(tmp_path / "forked")]
        # torch comes preloaded; torchtitan and this package each job imports itself.
        assert expected["loaded"] == {"torch": False, "torchtitan": False, "torchtitan_seq1f1b": False}
        assert forked["loaded"] == {"torch": True, "torchtitan": False, "torchtitan_seq1f1b": False}


@pytest.mark.parametrize(("action", "code", "message"), [
    ("fail-on-rank-0", 1, "ValueError: rank 0 refuses"),
    ("exit-3-on-rank-0", 3, ""),
])
def test_a_failing_rank_stops_the_others(tmp_path, action, code, message):
    # Rank 1 would sleep for 600 s, past the timeout: only stopping it ends the job.
    result = server_run(action, tmp_path, timeout=120)
    assert result.returncode == code
    assert message in result.stdout
    _assert_gone(int((tmp_path / "1.pid").read_text()))


def test_a_job_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        server_run("sleep", tmp_path, timeout=3)
    for rank in range(2):
        _assert_gone(int((tmp_path / f"{rank}.pid").read_text()))


def test_servers_are_kept_per_environment_of_the_libraries(tmp_path):
    """Variables only a job reads share a server; one a preloaded library reads at
    import (TORCH_LOGS) starts another, and the first stays for the next job."""
    base = dict(os.environ, OMP_NUM_THREADS="1")
    envs = [base, dict(base, SEQ1F1B_JOB_FACT="x"), dict(base, TORCH_LOGS="recompiles"), base]
    servers = []
    for index, env in enumerate(envs):
        (tmp_path / str(index)).mkdir()
        assert server_run("facts", tmp_path / str(index), env, nproc=1).returncode == 0
        servers.append(read_facts(tmp_path / str(index), nproc=1)[0]["server"])
    assert servers[0] == servers[1] == servers[3] != servers[2]


def _assert_gone(pid: int) -> None:
    """The process ``pid`` was reaped (no zombie left either)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

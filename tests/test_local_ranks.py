# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""How local ranks start: gloo ranks fork from a preloaded server yet run in the
caller's current environment and directory; GPU ranks spawn fresh."""

import os

import torch.distributed as dist

from torchtitan_seq1f1b import local_ranks
from torchtitan_seq1f1b.local_ranks import run_ranks


def _environment_and_directory(rank: int, world_size: int) -> tuple:
    return os.environ.get("SEQ1F1B_TEST_MARK"), os.getcwd(), dist.get_world_size()


def test_ranks_run_in_the_callers_current_environment_and_directory(monkeypatch, tmp_path):
    run_ranks(_environment_and_directory, 2)  # the server is running from here on
    monkeypatch.setenv("SEQ1F1B_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_ranks(_environment_and_directory, 2)
    assert ranks == [("set after the server started", str(tmp_path), 2)] * 2


def test_gpu_ranks_spawn_and_cpu_ranks_fork_from_the_server():
    assert local_ranks._context(__name__, "nccl").get_start_method() == "spawn"
    assert local_ranks._context(__name__, "gloo").get_start_method() == "forkserver"

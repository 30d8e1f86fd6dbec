# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Every command README.md and docs/*.md show works as written.

Commands are the lines of code blocks, and inline code spans with arguments,
that run ``torchrun``, ``python -m torchtitan_seq1f1b...`` or ``python -m
pytest``. The set-up part of the README's one-liners (venv, pip) is left out.
Long commands run at smoke size, changed only as ``smoke`` says; outputs go
to a scratch directory holding copies of docs/ and train_configs/. A
torchtitan job runs on the stack it is written for (a TOML config: 0.2.2;
``--module``: 0.3) and is skipped on the other; the README's main job runs
under torchrun, the others fork their ranks from the tests' job server
(``tests/check/test_job_server.py``: they train as under torchrun). The benchmark's commands are
in benchmarks/README.md, which is not read here (they take minutes); every
module a document names for ``python -m`` must still exist.
"""

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import JOB_SERVER, REPO
from torchtitan_seq1f1b.check.titan_runs import titan_release
from torchtitan_seq1f1b.integration import MAIN

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Documents whose commands are not run here, but whose modules must exist.
OTHER_DOCUMENTS = [REPO / "benchmarks" / "README.md", REPO / "tests" / "README.md"]
RUNNERS = ("torchrun ", "python -m torchtitan_seq1f1b", "python -m pytest")
SET_UP = ("python3 -m venv", ". .venv", "pip install")
SMOKE_SEQ_LEN = 256
TIMEOUT = 300
MAIN_JOB = (
    "torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_seq1f1b.toml"
)
# Options of torchtitan main's folded batch, which 0.3 lacks.
MAIN_ONLY_OPTIONS = {
    "--training.num_tokens_per_train_step", "--training.num_tokens_per_microbatch_per_dp_rank",
    "--parallelism.num_pp_microbatches",
}
# Documented jobs that run a config of torchtitan's registries rather than ours.
TORCHTITAN_CONFIGS = ("llama3_debugmodel",)
# Documented commands a test runs as written and checks in more detail.
RUN_BY_TESTS = {
    "python -m torchtitan_seq1f1b.check --device cpu": "tests/check/test_check.py::test_cpu_check_passes",
}


def _without_set_up(line: str) -> str:
    return " && ".join(p for p in line.split(" && ") if not p.strip().startswith(SET_UP))


def _without_outputs(command: str) -> tuple[str, ...]:
    """The command's arguments less the files it writes (``--json``, ``-o``)."""
    argv = shlex.split(command, comments=True)
    writes = {i + 1 for i, arg in enumerate(argv) if arg in ("--json", "-o")}
    return tuple(arg for i, arg in enumerate(argv) if i not in writes)


def documented_commands() -> list[str]:
    """Each documented command once: one that differs from an earlier one only in the
    files it writes runs the same code, and is left out."""
    commands, seen = [], set()
    for document in DOCUMENTS:
        text = document.read_text()
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
        indented = re.findall(r"(?:^    \S[^\n]*\n)+", text, flags=re.M)
        lines = [line.strip() for block in fenced + indented for line in block.splitlines()]
        inline = [
            " ".join(span.split())
            for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        ]
        inline = [s for s in inline if s.startswith(RUNNERS[1]) and len(s.split()) > 3]
        for line in lines + inline:
            command = _without_set_up(line)
            key = _without_outputs(command)
            if command.startswith(RUNNERS) and key not in seen:
                seen.add(key)
                commands.append(command)
    return commands


def _job_folder(config: str, command: str) -> str:
    """A dump folder per command: two jobs of one config (other flags) must not share checkpoints."""
    return f"{config}-{hashlib.sha1(command.encode()).hexdigest()[:8]}"


def smoke(command: str, scratch) -> list[str]:
    """argv of ``command`` at smoke size.

    torchrun jobs: 2 steps into a scratch dump folder of their own, per
    command (one job's checkpoint would make the next resume from it), and
    torchtitan's own configs (2048-token bf16 sequences, slow where a CPU has no
    bf16 units) at SMOKE_SEQ_LEN tokens; the plan command: sequences of at most
    SMOKE_SEQ_LEN tokens; pytest: collection only (running the suite from inside
    it would recurse).
    """
    argv = shlex.split(command, comments=True)
    if argv[0] == "torchrun":
        if _titan_release_of(command) in ("0.3", MAIN):
            config, dump_flag = argv[argv.index("--config") + 1], "--dump_folder"
        else:
            config = Path(argv[argv.index("--job.config_file") + 1]).stem
            dump_flag = "--job.dump_folder"
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", "localhost:0", *argv[1:],
                "--training.steps", "2",
                dump_flag, str(scratch / "outputs" / _job_folder(config, command))]
        if config in TORCHTITAN_CONFIGS:
            argv += ["--training.seq_len", str(SMOKE_SEQ_LEN)]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    module = argv[2]
    if module == "torchtitan_seq1f1b.plan" and "--seq-len" in argv:
        at = argv.index("--seq-len") + 1
        argv[at] = str(min(int(argv[at]), SMOKE_SEQ_LEN))
    if module == "pytest":
        argv.append("--collect-only")
    return argv


def _titan_release_of(command: str) -> str | None:
    """The torchtitan release a command is written for: a torchrun job's (main's if it
    sets an option only main has), or the plan command's job config (a TOML file: 0.2.2,
    a config function's name: 0.3); None: any."""
    argv = shlex.split(command, comments=True)
    if argv[0] == "torchrun" and MAIN_ONLY_OPTIONS & {arg.split("=")[0] for arg in argv}:
        return MAIN
    if argv[0] == "torchrun":
        return "0.3" if "--module" in argv else "0.2"
    if "--job-config" in argv:
        return "0.2" if argv[argv.index("--job-config") + 1].endswith(".toml") else "0.3"
    return None


def test_the_readme_and_docs_show_the_main_commands():
    # The README opens with the two fresh-machine one-liners: set up, then the main job
    # and the tests.
    readme = (REPO / "README.md").read_text().splitlines()
    first = [line.strip() for line in readme if line.startswith("    ")][:2]
    assert all(line.startswith("python3 -m venv .venv && ") for line in first), first
    assert [_without_set_up(line) for line in first] == [MAIN_JOB, "python -m pytest tests -q"]
    commands = documented_commands()
    assert commands[:2] == [_without_set_up(line) for line in first]
    for command in (
        "torchrun --nproc_per_node 2 -m torchtitan.train --module torchtitan_seq1f1b "
        "--config seq1f1b_debug",
        "python -m torchtitan_seq1f1b.simulate --schedule all",
        "python -m torchtitan_seq1f1b.check",
        "python -m torchtitan_seq1f1b.check --perf --json perf.json",
    ):
        assert command in commands, command


def _runnable(module: str) -> bool:
    """``python -m module`` runs from this checkout: a module file or a package's __main__."""
    path = REPO.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_module_the_documents_run_exists():
    """A command naming a module that moved (say ``torchtitan_seq1f1b.bench``) fails here
    even where its document is not run. Looked up in the checkout's files: an editable
    install's finder may answer for modules of another tree."""
    named = {
        module
        for document in DOCUMENTS + OTHER_DOCUMENTS
        for module in re.findall(r"python -m ([\w.]+)", document.read_text())
    }
    ours = sorted(m for m in named if m.split(".")[0] in ("torchtitan_seq1f1b", "benchmarks"))
    assert "benchmarks.cpu_bench" in ours and "torchtitan_seq1f1b.plan" in ours
    missing = [m for m in ours if not _runnable(m)]
    assert not missing, f"documented but not importable: {missing}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "docs", folder / "docs")
    (folder / "train_configs").symlink_to(REPO / "train_configs")
    (folder / "tests").symlink_to(REPO / "tests")
    return folder


@pytest.mark.parametrize(
    "command",
    [
        # Commands of no torchtitan release run the same on every stack: CI runs them on one.
        pytest.param(c, marks=[pytest.mark.main_stack_only] * (_titan_release_of(c) is None))
        for c in documented_commands()
    ],
)
def test_documented_command_works_as_written(command, scratch):
    if command in RUN_BY_TESTS:
        pytest.skip(f"{RUN_BY_TESTS[command]} runs it and reads its report")
    release = _titan_release_of(command)
    if release not in (None, titan_release()):
        pytest.skip(f"a torchtitan {release} job; this stack has torchtitan {titan_release()}")
    result = _run(command, scratch)
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}"
    if not command.startswith("torchrun"):
        return
    assert "Seq1F1B: trained steps 1-2" in result.stdout
    if release == "0.2":
        # torchtitan 0.3 prints its own step lines on every rank (loss -1
        # where a rank holds none) and its LOG_RANK advice; 0.2.2's adapter
        # leaves only the rank holding the loss.
        assert "loss: -1" not in result.stdout and "LOG_RANK" not in result.stdout


def _run(command: str, scratch) -> subprocess.CompletedProcess:
    """``command`` at smoke size in ``scratch``, its output in stdout."""
    argv = smoke(command, scratch)
    if command.startswith("torchrun") and command != MAIN_JOB:
        nproc = int(argv[argv.index("--nproc_per_node") + 1])
        at = argv.index("-m", 3)  # the trainer's, after python -m torch.distributed.run
        # torchrun's default for more than one rank per node
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return JOB_SERVER.run([argv[at + 1]], argv[at + 2:], nproc, env, scratch, TIMEOUT)
    return subprocess.run(
        argv, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=TIMEOUT,
    )

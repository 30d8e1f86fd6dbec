# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Fork the ranks of CPU torchtitan jobs from a server that imported their libraries once.

Under torchrun every rank starts an interpreter and imports torch and the rest
of what ``torchtitan.train`` loads, 7-10 s per rank on two cores: longer than a
test job trains. A :class:`JobServer` process imports those libraries once and
forks each job's ranks from itself. It imports everything ``import
torchtitan.train`` loads *except* torchtitan and this package, so every job
imports both afresh and their import-time hooks (this package's ``__init__``
hooks into torchtitan when torchtitan is loaded) run inside the job as they do
under torchrun.

A rank gets what torchrun gives it: the job's environment plus RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the
job's directory, also first on ``sys.path``; ``sys.argv`` of ``python -m
MODULE ARGS...``; stdout and stderr into the job's output; an error file for
the exception torch's ``@record`` saves, which ends the output as torchrun's
failure summary does. When a rank fails, the others get a few seconds to end
on their own before they are stopped, so a job whose every rank raises shows
every rank's error. CPU only: a fork cannot use CUDA that its parent initialised.

Variables the preloaded libraries read at import (``TORCH_LOGS``,
``OMP_NUM_THREADS``, ``PYTHON*``, ...) keep the value they had when the server
started, so a job runs on a server started with its environment: servers are
kept per environment, less the variables only a job's own code reads
(:data:`JOB_ONLY_VARIABLES`).

The server runs this file as a script, not as a module of the package, which
would load the package into the server ahead of torchtitan; so this module
imports only the standard library.
"""

import atexit
import importlib.util
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from pathlib import Path

__all__ = ["JOB_ONLY_VARIABLES", "JobServer"]

# Prefixes of variables read only by a job's own modules (this package, torchtitan,
# the tests' launchers) or changing every test: they do not select a server.
JOB_ONLY_VARIABLES = ("SEQ1F1B_", "LOG_RANK", "PYTEST_")
# What the server loads: the libraries of a torchtitan process, and where installed
# those its models import beyond them (qwen3_5's fla, which imports transformers).
PRELOAD_ROOT = "torchtitan.train"
OPTIONAL_PRELOAD_ROOTS = ("fla",)
# Loaded afresh by every job (see the module docstring).
NOT_PRELOADED = ("torchtitan", "torchtitan_seq1f1b", "__main__", "__mp_main__")
# Seconds the other ranks have to end after one failed, before SIGTERM; and
# between SIGTERM and SIGKILL.
FAILURE_GRACE = 5.0
STOP_GRACE = 5.0
# Seconds a server has to answer beyond its job's timeout before it counts as hung.
ANSWER_MARGIN = 120.0


class JobServer:
    """Runs jobs' ranks as forks of preloaded server processes, one per environment.

    At most ``max_servers`` server processes live at once (the least recently
    used one is closed). Servers start at their first job and end with
    :meth:`close`, or when this process exits.
    """

    def __init__(self, max_servers: int = 2):
        self.max_servers = max_servers
        self._servers: OrderedDict[tuple, _ServerProcess] = OrderedDict()
        # The modules to preload, found by the first server and read by the others.
        self._preload_list: Path | None = None
        atexit.register(self.close)

    def run(
        self,
        modules: list[str],
        args: list[str],
        nproc: int,
        env: dict[str, str],
        cwd: Path,
        timeout: float,
    ) -> subprocess.CompletedProcess:
        """``python -m modules[0] modules[1:]... args`` on ``nproc`` ranks in ``cwd``.

        Returns the ranks' combined stdout and stderr and a return code: 0, or
        the code of the first rank to fail. Raises ``subprocess.TimeoutExpired``
        (after killing every rank) if the job does not end in ``timeout`` seconds.
        """
        key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(JOB_ONLY_VARIABLES)))
        server = self._servers.pop(key, None)
        if server is None or not server.alive():
            if self._preload_list is None:
                self._preload_list = Path(tempfile.mkdtemp(prefix="job-server-")) / "modules.txt"
            server = _ServerProcess(dict(key), cwd, self._preload_list)
        self._servers[key] = server
        while len(self._servers) > self.max_servers:
            self._servers.popitem(last=False)[1].close()
        command = ["python", "-m", *modules, *args]
        with tempfile.NamedTemporaryFile(prefix="job-", suffix=".log") as output:
            answer = server.ask(
                {
                    "modules": modules,
                    "args": args,
                    "nproc": nproc,
                    "env": env,
                    "cwd": str(cwd),
                    "output": output.name,
                    "timeout": timeout,
                },
                timeout + ANSWER_MARGIN,
            )
            text = Path(output.name).read_text(errors="replace")
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, output=text)
        return subprocess.CompletedProcess(command, answer["returncode"], stdout=text)

    def close(self) -> None:
        while self._servers:
            self._servers.popitem()[1].close()
        if self._preload_list is not None:
            shutil.rmtree(self._preload_list.parent, ignore_errors=True)
            self._preload_list = None


class _ServerProcess:
    """One server: this file run as a script, answering one job per line of stdin."""

    def __init__(self, env: dict[str, str], cwd: Path, preload_list: Path):
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(preload_list)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=cwd,
            text=True,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, job: dict, timeout: float) -> dict:
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # reported below, with the server's output
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            self.process.wait()
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")[-6000:]
            raise RuntimeError(
                f"the job server (pid {self.process.pid}) "
                f"{'hung' if ready == [] else 'died'} (exit code {self.process.returncode}):\n{log}"
            )
        return json.loads(line)

    def close(self) -> None:
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


# The server side: runs in the process started by _ServerProcess.


def _preload(preload_list: Path) -> None:
    """Import what ``import torchtitan.train`` (and each installed one of
    :data:`OPTIONAL_PRELOAD_ROOTS`) loads, except :data:`NOT_PRELOADED`; the names
    listed in ``preload_list``, which the first server writes."""
    if not preload_list.exists():
        optional = [root for root in OPTIONAL_PRELOAD_ROOTS if importlib.util.find_spec(root)]
        imports = ", ".join([PRELOAD_ROOT, *optional])
        listing = subprocess.run(
            [sys.executable, "-c", f"import sys, {imports}; print('\\n'.join(sys.modules))"],
            capture_output=True,
            text=True,
            check=True,
        )
        preload_list.write_text(listing.stdout)
    for name in preload_list.read_text().split():
        if name.split(".")[0] in NOT_PRELOADED:
            continue
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module only importable in its own context
            pass
    loaded = [name for name in NOT_PRELOADED[:2] if name in sys.modules]
    if loaded:
        raise RuntimeError(f"preloading the libraries of {PRELOAD_ROOT} loaded {loaded}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_code(code) -> int:
    """The process exit code of ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_rank(job: dict, rank: int, port: int, error_file: Path) -> None:
    """In a fork: one rank of ``job``, as ``python -m`` under torchrun runs it; never returns."""
    code = 1
    try:
        output = os.open(job["output"], os.O_WRONLY | os.O_APPEND)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(job["env"])
        nproc = str(job["nproc"])
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
            WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc,
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            TORCHELASTIC_ERROR_FILE=str(error_file),
        )
        os.chdir(job["cwd"])
        sys.path[0] = job["cwd"]
        first, *rest = job["modules"]
        sys.argv = [first, *rest, *job["args"]]
        try:
            runpy.run_module(first, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the rank's own set-up failed
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_job(job: dict) -> dict:
    """Forks ``job``'s ranks and waits for them: {"timed_out", "returncode"}."""
    port = _free_port()
    errors = Path(tempfile.mkdtemp(prefix="job-errors-"))
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(job, rank, port, errors / f"{rank}.json")
        ranks[pid] = rank
    deadline = time.monotonic() + job["timeout"]
    codes: dict[int, int] = {}  # rank -> exit code, in the order the ranks ended
    failed_at = stopped_at = None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
            if code != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        if now > deadline:
            _signal(ranks, signal.SIGKILL)
            for pid in ranks:
                os.waitpid(pid, 0)
            shutil.rmtree(errors)
            return {"timed_out": True, "returncode": None}
        if failed_at is not None and stopped_at is None and now > failed_at + FAILURE_GRACE:
            stopped_at = now
            _signal(ranks, signal.SIGTERM)
        if stopped_at is not None and now > stopped_at + STOP_GRACE:
            _signal(ranks, signal.SIGKILL)
        time.sleep(0.05)
    failed = [rank for rank, code in sorted(codes.items()) if code != 0]
    if failed:
        with open(job["output"], "a") as output:
            output.write(_failure_summary(failed, codes, errors))
    shutil.rmtree(errors)
    first_failure = next((code for code in codes.values() if code != 0), 0)
    return {"timed_out": False, "returncode": first_failure}


def _failure_summary(failed: list[int], codes: dict[int, int], errors: Path) -> str:
    """What torchrun prints of failed ranks: exit code and the error each rank recorded."""
    lines = ["job failed:"]
    for rank in failed:
        lines.append(f"  rank {rank}: exit code {codes[rank]}")
        error_file = errors / f"{rank}.json"
        if error_file.exists():
            message = json.loads(error_file.read_text())["message"]
            text = message["message"] if isinstance(message, dict) else message
            lines.extend(f"    {line}" for line in text.splitlines())
    return "\n".join(lines) + "\n"


def _signal(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _serve() -> None:
    sys.path[0] = os.getcwd()  # as ``python -m`` has it, not this file's folder
    _preload(Path(sys.argv[1]))
    for line in sys.stdin:
        answer = _run_job(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()

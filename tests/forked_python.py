"""`python SCRIPT ARGS` for the tests, forked from a process that has already imported torch.

Importing torch, torchvision and the project takes 2.5 to 6 s of a 2-core machine's time; a test that
checks a one-line error runs for a quarter of a second after that. Most of the suite's command-line
tests are such runs, so helpers.run_command hands them here: one server process (started with
the environment run_command gives every command) imports the heavy modules once and forks a child
per command. The child is what `python SCRIPT ARGS` would be from then on: sys.argv, sys.path[0],
the working directory and the environment set, stdin empty, stdout and stderr to files, the script
run as __main__, and a normal interpreter exit (atexit handlers, flushed streams, the exit status
of SystemExit or 1 after a traceback).

Only commands whose environment equals the server's come here: variables that torch reads at import
(OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, ...) would otherwise differ (helpers.py keeps a server for each
environment it forks in). The one exception is PYTEST_CURRENT_TEST, which pytest changes for every
test and nothing reads at import: the child takes the command's environment, that variable included.
The server refuses to serve (and run_command starts real processes) if importing printed anything,
which every command would then have printed, or if the imports left a Python thread running, which
a fork would not copy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
# Variables that may differ between the server and a command it forks: pytest's per-test marker.
PER_COMMAND_VARIABLES = {"PYTEST_CURRENT_TEST"}
PRELOADED = ("torch", "torchvision", "numpy", "PIL.Image", "torch.utils.tensorboard", "common.engine", "common.cli",
             "common.models", "common.pipelines", "common.data", "common.spawn", "common.distributed",
             "common.checkpoint", "common.telemetry", "common.precision", "common.errors")


class ForkServer:
    """The client side, in the test process: run(argv, cwd, env, timeout) -> CompletedProcess."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.process = subprocess.Popen([sys.executable, __file__], env=self.env, cwd=REPO, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        hello = self.process.stdout.readline()
        self.ready = hello.strip() == "ready"
        if not self.ready:
            self.refusal = hello.strip() or self.process.stderr.read()
            self.close()

    def serves(self, argv, env: dict) -> bool:
        """Whether this command can be a fork: `python SCRIPT.py ...` or `python -m MODULE ...`, same environment."""
        return (self.ready and self.process.poll() is None and lasting(env) == lasting(self.env) and len(argv) >= 2
                and argv[0] == sys.executable and (argv[1].endswith(".py") or (argv[1] == "-m" and len(argv) >= 3)))

    def run(self, argv, cwd, env: dict, timeout: Optional[float]) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="forked-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            self.process.stdin.write(json.dumps({"argv": argv[1:], "cwd": str(cwd), "env": env, "stdout": str(out),
                                                 "stderr": str(err)}) + "\n")
            self.process.stdin.flush()
            pid = int(self._reply(argv))
            timed_out = threading.Event()
            timer = threading.Timer(timeout, lambda: timed_out.set() or _kill(pid)) if timeout else None
            if timer:
                timer.start()
            try:
                status = int(self._reply(argv))
            finally:
                if timer:
                    timer.cancel()
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if timed_out.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, status, stdout, stderr)

    def _reply(self, argv) -> str:
        line = self.process.stdout.readline()
        if not line.strip():  # the server ended: say so, not a ValueError about an empty string
            raise RuntimeError(f"the fork server ended while running {argv}: {self.process.stderr.read()[-2000:]}")
        return line

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def lasting(env: dict) -> dict:
    """The environment less the variables that may differ between server and command."""
    return {name: value for name, value in env.items() if name not in PER_COMMAND_VARIABLES}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


# --- the server side ---

def _serve() -> Optional[dict]:
    """Import, then fork one child per request; returns the request in the child, None in the server at EOF."""
    control_in, control_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w", buffering=1)
    with tempfile.TemporaryFile() as imports_said:
        os.dup2(imports_said.fileno(), 1)
        os.dup2(imports_said.fileno(), 2)
        sys.path.insert(0, str(REPO))
        import importlib

        for name in PRELOADED:
            importlib.import_module(name)
        sys.path.pop(0)
        sys.stdout.flush()
        sys.stderr.flush()
        imports_said.seek(0)
        said = imports_said.read().decode(errors="replace").strip()
    # Python's threads: a fork copies none of them. (numpy's OpenBLAS starts a native pool at import;
    # it stops and restarts it around a fork itself, as every forked DataLoader worker relies on.)
    threads = threading.active_count()
    with open(os.devnull, "r+b") as null:
        for fd in (0, 1, 2):
            os.dup2(null.fileno(), fd)
    if said or threads != 1:
        control_out.write(f"refused: importing printed {said[:200]!r}\n" if said else
                          f"refused: importing left {threads} threads\n")
        return None
    control_out.write("ready\n")
    for line in control_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            control_in.close()
            control_out.close()
            return request
        control_out.write(f"{pid}\n")
        _, wait_status = os.waitpid(pid, 0)
        control_out.write(f"{os.waitstatus_to_exitcode(wait_status)}\n")
    return None


def _run_as_main(request: dict) -> None:
    import runpy

    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        with open(path, "wb") as handle:
            os.dup2(handle.fileno(), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # multiprocessing noted the server's directory at import; `python SCRIPT` would note this one
    # (spawned workers find a relative main script from it).
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = os.getcwd()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.path.pop(0)  # this folder, which `python tests/forked_python.py` put first: not the script's
    request = _serve()
    if request is None:
        sys.exit(0)
    _run_as_main(request)  # SystemExit and exceptions end this child as they end `python SCRIPT`

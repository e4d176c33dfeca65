"""run_command forks `python SCRIPT` from a process that imported torch once (tests/forked_python.py):
the fork must really happen under pytest (which changes PYTEST_CURRENT_TEST for every test), and
the child must behave as `python SCRIPT` would: argv, working directory, environment, empty stdin,
its own stdout and stderr, and the exit status of sys.exit, an exception or a signal."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from helpers import run_command, run_script

PROBE = '''
import json, os, sys
preloaded = "torch" in sys.modules  # a fresh interpreter has not imported torch yet
print(json.dumps({"preloaded": preloaded, "argv": sys.argv, "cwd": os.getcwd(), "stdin": sys.stdin.read(),
                  "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "marker": os.environ.get("PROBE_MARKER")}))
print("to stderr", file=sys.stderr)
how = sys.argv[1] if len(sys.argv) > 1 else ""
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("raised on purpose")
if how == "signal":
    os.kill(os.getpid(), 15)
'''


def probe(tmp_path, *args, **kwargs):
    import json

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = run_script([script, *args], cwd=tmp_path, **kwargs)
    return result, (json.loads(result.stdout.splitlines()[0]) if result.stdout else None)


@pytest.mark.skipif(os.environ.get("IMAGENET_TESTS_FORK") == "0", reason="IMAGENET_TESTS_FORK=0: nothing is forked")
def test_a_command_under_pytest_is_forked_and_sees_what_python_script_would(tmp_path, monkeypatch):
    with monkeypatch.context() as earlier_test:  # the server may have started in another test
        earlier_test.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_other (call)")
        assert probe(tmp_path)[1]["preloaded"] is True
    result, seen = probe(tmp_path, "a b")
    assert result.returncode == 0, result.stderr
    assert seen["preloaded"] is True  # forked: torch came with the server
    assert seen["argv"] == [str(tmp_path / "probe.py"), "a b"]
    assert seen["cwd"] == str(tmp_path) and seen["stdin"] == ""
    assert seen["test"] == os.environ["PYTEST_CURRENT_TEST"]  # this test's, not the server's
    assert result.stderr == "to stderr\n"


def test_exit_statuses_are_those_of_python_script(tmp_path):
    assert probe(tmp_path, "exit")[0].returncode == 3
    raised, _ = probe(tmp_path, "raise")
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: raised on purpose")
    assert probe(tmp_path, "signal")[0].returncode == -signal.SIGTERM


def test_a_command_in_another_environment_starts_a_fresh_interpreter(tmp_path):
    _, seen = probe(tmp_path, env_extra={"PROBE_MARKER": "x"})
    assert (seen["preloaded"], seen["marker"]) == (False, "x")


def test_a_module_runs_as_python_m_would(tmp_path):
    result = run_command([sys.executable, "-m", "common.tools.demo_data", "--help"])
    assert result.returncode == 0 and result.stdout.startswith("usage:")

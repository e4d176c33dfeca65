"""Fault tolerance end to end on the CPU (gloo, 2 processes, SqueezeNet 1.0,
which has no BatchNorm): a worker killed under torchrun --max-restarts, a
Slurm preemption signal with requeue, a truncated checkpoint, and two "nodes"
on one machine (on 127.0.0.1, and across two network namespaces).

Each training step is too quick (~30 ms) to signal a run reliably in the
middle of an epoch, so the interrupted runs are slowed down from outside: a
sitecustomize.py on PYTHONPATH makes every SGD step sleep first. It also
appends each process's step count to a file, so a test can see how many
steps every rank took, not only rank 0. Sleeping changes no number, so the
slowed runs are compared with unslowed uninterrupted ones.

Every process a test starts carries a marker in its environment; whatever
happens, the test ends by killing every process that carries it (torchrun
starts its workers in sessions of their own, so process groups are not enough).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from common import rundir

from helpers import (REPO, free_port, load_checkpoint, make_image_folder, max_abs_diff, metrics_rows, running,
                     single_run_dir, slowed_steps, weights, write_slow_steps)

TORCHRUN = Path(sys.executable).parent / "torchrun"
SCRIPT = REPO / "imagenet_ddp.py"
EPOCHS = 2
STEPS_PER_EPOCH = 6  # 48 training images, 4 per process x 2 processes
TRAIN_IMAGES, VAL_IMAGES = 48, 9
MODEL = ["-a", "squeezenet1_0", "--device", "cpu", "-j", "0", "--image-size", "32", "--val-resize", "32", "-b", "4",
         "--print-freq", "1", "--io-interval", "0", "--seed", "0"]
STEP_DELAY = 0.5  # seconds each optimizer step of a slowed run sleeps: room to act between two steps
# Every test here starts, stops and restarts multi-process jobs (tens of seconds each): `make test`
# leaves them to CI and `make test-all` (docs/tests.md).
pytestmark = pytest.mark.slow

SLURM_JOB = "4242"
EX_TEMPFAIL = 75  # the documented status after a signal stop with its checkpoint written

CHECKPOINT_LINE = re.compile(r"checkpoint: epoch (\d+) step (\d+)/(\d+) saved to (\S+)")
CONTINUING_LINE = re.compile(r"--resume auto: continuing (\S+) \(epoch (\d+)(?:, step (\d+)| after (\d+) steps?)?")
FRESH_LINE = re.compile(r"--resume auto: no checkpoint in (\S+) yet; starting from scratch")
STOP_LINE = re.compile(r"stopping at epoch (\d+) step (\d+)/(\d+) on SIGUSR1\b[^:]*: checkpoint saved to (\S+)")

# --- processes: start, read, find, stop ---

def tagged_processes(tag: str) -> list:
    """Pids of every live process whose environment carries FT_TEST_TAG=tag."""
    marker = f"FT_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and running(int(entry)):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def environ_of(pid: int) -> dict:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode(errors="replace").split("=", 1) for pair in pairs if b"=" in pair)


class Job:
    """One launched command, its output (stdout and stderr together) read
    line by line in the background so a test can wait for a line."""

    def __init__(self, argv, env_extra: dict, tag: str):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   FT_TEST_TAG=tag, **env_extra)
        self.argv = [str(arg) for arg in argv]
        self.process = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: re.Pattern, timeout: float = 120) -> re.Match:
        """The first output line matching `pattern`, waiting for it."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._changed:
            while True:
                for line in self.lines[checked:]:
                    match = pattern.search(line)
                    if match:
                        return match
                checked = len(self.lines)
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"exited ({self.process.returncode}) before printing "
                                         f"{pattern.pattern!r}:\n{''.join(self.lines)[-6000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {pattern.pattern!r} within {timeout} s:\n{''.join(self.lines)[-6000:]}")
                self._changed.wait(0.5)

    def finish(self, timeout: float = 180) -> int:
        """The exit status, waiting for it and for the rest of the output."""
        try:
            self.process.wait(timeout=timeout)
            self.ended_at = time.monotonic()
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s: {' '.join(self.argv)}\n"
                                 f"{self.output[-6000:]}") from None
        self._reader.join(timeout=10)
        return self.process.returncode


class Launcher:
    """Starts jobs whose processes all carry one marker, and kills whatever
    carries it at the end of the test."""

    def __init__(self, slow_dir: Path):
        self.tag = uuid.uuid4().hex
        self.slow_dir = slow_dir
        self.jobs: list = []

    def start(self, argv, env_extra=None, slow=False, step_log: Path | None = None) -> Job:
        env_extra = dict(env_extra or {})
        if slow or step_log is not None:
            env_extra.update(slowed_steps(self.slow_dir, STEP_DELAY if slow else 0.0, step_log))
        job = Job(argv, env_extra, self.tag)
        self.jobs.append(job)
        return job

    def leftovers(self, wait: float = 0.0) -> list:
        deadline = time.monotonic() + wait
        while True:
            left = tagged_processes(self.tag)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)

    def kill_all(self):
        for job in self.jobs:
            if job.process.poll() is None:
                try:
                    os.kill(job.process.pid, signal.SIGSTOP)  # a frozen launcher starts no new workers
                except ProcessLookupError:
                    pass
        for _ in range(3):
            for pid in tagged_processes(self.tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for job in self.jobs:
            try:
                os.killpg(job.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            job.process.wait(timeout=30)
            job._reader.join(timeout=10)


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory) -> Path:
    return write_slow_steps(tmp_path_factory.mktemp("slow-steps"))


@pytest.fixture
def launcher(slow_dir):
    launcher = Launcher(slow_dir)
    try:
        yield launcher
    finally:
        launcher.kill_all()


def workers_of(launcher_pid: int, tag: str, timeout: float = 60) -> dict:
    """{rank: pid} of the training processes under a torchrun agent (RANK in their environment)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for pid in tagged_processes(tag):
            try:
                environ = environ_of(pid)
                if parent_of(pid) == launcher_pid and "TORCHELASTIC_RUN_ID" in environ:
                    found[int(environ["RANK"])] = pid
            except (OSError, KeyError, ValueError):
                continue
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def spawned_workers(parent: int, tag: str) -> list:
    """Pids of the training processes the plain-python spawner started (not multiprocessing's resource tracker)."""
    found = []
    for pid in tagged_processes(tag):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if parent_of(pid) == parent and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(pid)
        except OSError:
            continue
    return found


# --- run directories ---

def assert_each_epoch_once(run_dir: Path, epochs: int = EPOCHS, reference: Path | None = None):
    """metrics.csv has one train and one val row per epoch, in order, each
    counting the whole epoch; with a reference run, the same numbers."""
    rows = metrics_rows(run_dir)
    assert [(row["epoch"], row["split"]) for row in rows] == \
        [(str(epoch), split) for epoch in range(epochs) for split in ("train", "val")], rows
    for row in rows:
        assert int(row["images"]) == (TRAIN_IMAGES if row["split"] == "train" else VAL_IMAGES), row
    if reference is not None:
        for row, expected in zip(rows, metrics_rows(reference)):
            assert (row["images"], row["steps"], row["lr"]) == (expected["images"], expected["steps"], expected["lr"])
            for column in ("loss", "top1", "top5"):
                assert float(row[column]) == pytest.approx(float(expected[column]), abs=1e-4), (column, row, expected)


def continued_from(output: str) -> tuple:
    """(checkpoint, epoch, steps done in it) of the one "--resume auto: continuing" line."""
    found = CONTINUING_LINE.findall(output)
    assert len(found) == 1, output
    path, epoch, step, steps = found[0]
    return Path(path), int(epoch), int(step or steps or 0)  # no step: the epoch's start


def step_counts(step_log: Path) -> list:
    """Optimizer steps each training process of a slowed run took, sorted."""
    return sorted(int(path.read_text()) for path in step_log.iterdir())


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its size, modification time and content; run.lock's time
    aside: a start takes the directory's lock before it reads a checkpoint there (common/session.py),
    so even a start refused for its checkpoints writes the lock's record and empties it again."""
    return {str(path.relative_to(folder)): (path.stat().st_size,
                                            None if path.name == rundir.LOCK_NAME else path.stat().st_mtime_ns,
                                            path.read_bytes())
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("fault-tolerance") / "data", train_per_class=16)


def torchrun_single_node(port: int, max_restarts: int) -> list:
    return [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def spawned_reference(data, tmp_path_factory, slow_dir) -> Path:
    """An uninterrupted 2-epoch run started with plain python (the spawner), with no new flags."""
    logdir = tmp_path_factory.mktemp("spawned-reference")
    launcher = Launcher(slow_dir)
    try:
        job = launcher.start([sys.executable, SCRIPT, "--nproc-per-node", "2", data, *MODEL, "--epochs", EPOCHS,
                              "--logdir", logdir, "--run-name", "reference"])
        assert job.finish() == 0, job.output
    finally:
        launcher.kill_all()
    return logdir / "reference"


# --- a worker killed under torchrun ---

def kill_rank_1_mid_epoch(launcher: Launcher, data: Path, logdir: Path, max_restarts: int):
    """A slowed torchrun job with --resume auto: once it has written a
    mid-epoch checkpoint, SIGKILL rank 1. Returns the job, the checkpoint
    line seen, when the kill was sent and {rank: pid} of the workers."""
    job = launcher.start([*torchrun_single_node(free_port(), max_restarts), SCRIPT, data, *MODEL,
                          "--epochs", EPOCHS, "--logdir", logdir, "--run-name", "R", "--resume", "auto",
                          "--checkpoint-every", "2steps"], slow=True)
    checkpoint_line = job.wait_for(CHECKPOINT_LINE)
    workers = workers_of(job.process.pid, launcher.tag)
    assert sorted(workers) == [0, 1], (workers, job.output)
    os.kill(workers[1], signal.SIGKILL)
    return job, checkpoint_line, time.monotonic(), workers


@pytest.fixture(scope="module")
def torchrun_reference(data, tmp_path_factory, slow_dir) -> Path:
    """The torchrun command of the kill test, uninterrupted, under another run name."""
    logdir = tmp_path_factory.mktemp("torchrun-reference")
    launcher = Launcher(slow_dir)
    try:
        job = launcher.start([*torchrun_single_node(free_port(), 1), SCRIPT, data, *MODEL, "--epochs", EPOCHS,
                              "--logdir", logdir, "--run-name", "uninterrupted", "--resume", "auto",
                              "--checkpoint-every", "2steps"])
        assert job.finish() == 0, job.output
    finally:
        launcher.kill_all()
    return logdir / "uninterrupted"


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_ends_with_the_uninterrupted_weights(
        data, tmp_path, launcher, torchrun_reference):
    job, checkpoint_line, _, _ = kill_rank_1_mid_epoch(launcher, data, tmp_path, max_restarts=1)
    assert job.finish(timeout=120) == 0, job.output
    output = job.output
    run_dir = tmp_path / "R"
    fresh = FRESH_LINE.search(output)
    assert fresh and Path(fresh.group(1)) == run_dir, output
    epoch, step, steps = map(int, checkpoint_line.groups()[:3])
    assert (epoch, steps) == (0, STEPS_PER_EPOCH) and 0 < step < STEPS_PER_EPOCH
    # The restarted workers continued from a mid-epoch checkpoint written before (or at) the kill.
    path, resumed_epoch, resumed_step = continued_from(output)
    assert path.parent == run_dir and resumed_epoch == 0 and step <= resumed_step < STEPS_PER_EPOCH, output
    assert output.count("finished 2 epochs") == 1, output
    assert max_abs_diff(weights(run_dir), weights(torchrun_reference)) <= 1e-6
    assert_each_epoch_once(run_dir, reference=torchrun_reference)
    assert launcher.leftovers(wait=10) == []


def test_without_restarts_a_killed_worker_ends_the_job_within_60_s_naming_its_rank(data, tmp_path, launcher):
    job, _, killed_at, workers = kill_rank_1_mid_epoch(launcher, data, tmp_path, max_restarts=0)
    status = job.finish(timeout=120)
    seconds = job.ended_at - killed_at
    output = job.output
    assert status != 0, output
    assert seconds < 60, (seconds, output)
    # torchrun's failure summary: the root cause is rank 1, killed by SIGKILL.
    root_cause = output.split("Root Cause (first observed failure):", 1)
    assert len(root_cause) == 2, output
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 \(pid: %d\)" % workers[1], root_cause[1]), output
    # The checkpoint written before the kill is whole (written to a temporary name, then renamed).
    assert load_checkpoint(tmp_path / "R" / "checkpoint.pth.tar")["step"] >= 2
    assert launcher.leftovers(wait=10) == []


# --- preemption: SIGUSR1 under Slurm, requeue, resume ---

@pytest.fixture
def fake_scontrol(tmp_path) -> tuple:
    """A directory to put first on PATH, holding an `scontrol` that appends its arguments to a file."""
    folder, calls = tmp_path / "fake-bin", tmp_path / "scontrol-calls.txt"
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    script.chmod(0o755)
    return folder, calls


def slurm_environment(fake_bin: Path, **extra) -> dict:
    return {"SLURM_JOB_ID": SLURM_JOB, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", **extra}


def preempt(launcher: Launcher, command: list, env: dict, step_log: Path, signal_whom) -> tuple:
    """Start a slowed run, send SIGUSR1 to the processes `signal_whom(job)`
    names once it is in the middle of epoch 0, and check what every rank did:
    one stop line, all ranks stopped after the same number of steps, the
    checkpoint holds that step. Returns the job, (epoch, step) and the
    checkpoint path."""
    job = launcher.start(command, env, slow=True, step_log=step_log)
    job.wait_for(re.compile(r"train epoch 0 \[2/%d\]" % STEPS_PER_EPOCH))
    for pid in signal_whom(job):
        os.kill(pid, signal.SIGUSR1)
    job.finish(timeout=90)
    output = job.output
    stops = STOP_LINE.findall(output)
    assert len(stops) == 1, output
    epoch, step, steps, path = int(stops[0][0]), int(stops[0][1]), int(stops[0][2]), Path(stops[0][3])
    assert epoch == 0 and steps == STEPS_PER_EPOCH and 2 <= step < STEPS_PER_EPOCH, output
    assert path.is_file(), output
    state = load_checkpoint(path)
    assert (state["epoch"], state["step"]) == (epoch, step), {key: state.get(key) for key in ("epoch", "step")}
    assert step_counts(step_log) == [step, step], output  # every rank took exactly the steps the checkpoint holds
    return job, (epoch, step), path


def spawner_and_its_workers(launcher: Launcher):
    def whom(job: Job) -> list:
        workers = spawned_workers(job.process.pid, launcher.tag)
        assert len(workers) == 2, job.output
        return [job.process.pid, *workers]
    return whom


@pytest.mark.slow
def test_sigusr1_under_slurm_stops_every_rank_at_one_step_requeues_once_and_resumes_exactly(
        data, tmp_path, launcher, fake_scontrol, spawned_reference):
    fake_bin, calls = fake_scontrol
    env = slurm_environment(fake_bin)
    # No --run-name: the run directory comes from the Slurm job id, the same after a requeue.
    command = [sys.executable, SCRIPT, "--nproc-per-node", "2", data, *MODEL, "--epochs", EPOCHS,
               "--logdir", tmp_path / "runs", "--resume", "auto", "--checkpoint-every", "0"]
    run_dir = tmp_path / "runs" / f"slurm-{SLURM_JOB}"
    # As Slurm signals a job step (--signal=USR1@180): every process of it, the spawner and its workers.
    job, (epoch, step), path = preempt(launcher, command, env, tmp_path / "steps-before",
                                       spawner_and_its_workers(launcher))
    assert job.process.returncode == EX_TEMPFAIL, job.output
    assert path.parent == run_dir
    assert f"requeued Slurm job {SLURM_JOB} (scontrol requeue {SLURM_JOB})" in job.output, job.output
    assert calls.read_text().splitlines() == [f"requeue {SLURM_JOB}"]
    assert launcher.leftovers(wait=10) == []

    # The requeued job runs the same command again, with no signal this time.
    steps_after = tmp_path / "steps-after"
    again = launcher.start(command, env, step_log=steps_after)
    assert again.finish() == 0, again.output
    resumed_from, resumed_epoch, resumed_step = continued_from(again.output)
    assert resumed_from.parent == run_dir and (resumed_epoch, resumed_step) == (epoch, step), again.output
    assert step_counts(steps_after) == [EPOCHS * STEPS_PER_EPOCH - step] * 2  # no step repeated, none missing
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-6
    assert_each_epoch_once(run_dir, reference=spawned_reference)
    assert calls.read_text().splitlines() == [f"requeue {SLURM_JOB}"]  # a finished run requeues nothing


def test_sigusr1_to_the_spawner_alone_reaches_its_workers(data, tmp_path, launcher, fake_scontrol):
    fake_bin, calls = fake_scontrol
    command = [sys.executable, SCRIPT, "--nproc-per-node", "2", data, *MODEL, "--epochs", EPOCHS,
               "--logdir", tmp_path, "--run-name", "P", "--resume", "auto", "--checkpoint-every", "0"]
    job, _, path = preempt(launcher, command, slurm_environment(fake_bin), tmp_path / "steps",
                           lambda job: [job.process.pid])
    assert job.process.returncode == EX_TEMPFAIL, job.output
    assert path.parent == tmp_path / "P"
    assert calls.read_text().splitlines() == [f"requeue {SLURM_JOB}"]
    assert launcher.leftovers(wait=10) == []


def test_sigusr1_to_torchrun_reaches_its_workers_when_it_is_told_to_forward_it(
        data, tmp_path, launcher, fake_scontrol):
    fake_bin, calls = fake_scontrol
    # As run_scripts/ do: the default of torchrun's --signals-to-handle. (torchrun overwrites
    # TORCHELASTIC_SIGNALS_TO_HANDLE from that option, so exporting that variable does nothing.)
    env = slurm_environment(fake_bin, PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    command = [*torchrun_single_node(free_port(), 0), SCRIPT, data, *MODEL, "--epochs", EPOCHS,
               "--logdir", tmp_path, "--resume", "auto", "--checkpoint-every", "0"]
    job, _, path = preempt(launcher, command, env, tmp_path / "steps", lambda job: [job.process.pid])
    # torchrun's own status: its workers did not finish, and SIGUSR1 did not kill it.
    assert job.process.returncode not in (0, -signal.SIGUSR1), (job.process.returncode, job.output)
    # The workers stopped on the signal itself (preempt: one stop line, the checkpoint of that step) and
    # exited before torchrun's SIGKILL, 30 s after it forwarded the signal: torchrun says so when it has to
    # kill (its own words, not a clock, which a busy machine would stretch).
    assert re.search(r"(closing signal|via signal) SIGUSR1", job.output), job.output  # its log is shown
    assert "forcefully exiting via" not in job.output, job.output
    assert path.parent == tmp_path / f"slurm-{SLURM_JOB}"  # under Slurm, the Slurm job names the run
    assert calls.read_text().splitlines() == [f"requeue {SLURM_JOB}"]
    assert launcher.leftovers(wait=10) == []


# --- a truncated checkpoint ---

def truncate_to_half(path: Path) -> None:
    """Cut `path` to its first half, in place: where it is a hard link to a
    kept checkpoint file, that name loses its content too, and the run must
    go back to an older state."""
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.slow
def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one_and_never_to_scratch(
        data, tmp_path, launcher, spawned_reference):
    def command(epochs):
        return [sys.executable, SCRIPT, "--nproc-per-node", "2", data, *MODEL, "--epochs", epochs,
                "--logdir", tmp_path, "--run-name", "C", "--resume", "auto", "--checkpoint-every", "2steps",
                "--keep-checkpoints", "3"]

    run_dir = tmp_path / "C"
    first = launcher.start(command(1))
    assert first.finish() == 0, first.output
    kept = sorted(run_dir.glob("checkpoint-epoch*.pth.tar"))
    assert 1 <= len(kept) <= 3, kept
    newest = run_dir / "checkpoint.pth.tar"
    assert load_checkpoint(newest)  # readable before it is damaged
    truncate_to_half(newest)

    second = launcher.start(command(EPOCHS))
    assert second.finish() == 0, second.output
    # checkpoint.pth.tar is the newest kept file under another name: the warning names both.
    warning = re.search(r"warning: (\S+) \((\S+)\) is not a readable checkpoint \(.+\); "
                        r"using the previous checkpoint (\S+)", second.output)
    assert warning and Path(warning.group(2)) == newest and Path(warning.group(1)) in kept, second.output
    previous = Path(warning.group(3))
    assert previous in kept, (previous, kept)
    resumed_from, resumed_epoch, resumed_step = continued_from(second.output)
    assert resumed_from == previous, second.output
    named = re.fullmatch(r"checkpoint-epoch(\d+)-images(\d+)\.pth\.tar", previous.name)
    images_per_step = 2 * 4  # 2 processes x -b 4
    assert named and (resumed_epoch, resumed_step * images_per_step) == (int(named.group(1)), int(named.group(2))), \
        second.output
    assert "starting from scratch" not in second.output
    # The previous checkpoint is mid-epoch or an epoch end; either way the run ends as an uninterrupted one.
    assert max_abs_diff(weights(newest), weights(spawned_reference)) <= 1e-6
    assert_each_epoch_once(run_dir, reference=spawned_reference)

    # Every checkpoint damaged: an error, exit 2, and the run directory as it was.
    for path in run_dir.glob("*.pth.tar"):
        truncate_to_half(path)
    before = snapshot(run_dir)
    third = launcher.start(command(EPOCHS + 1))
    assert third.finish() == 2, third.output
    errors = [line for line in third.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(run_dir) in errors[0], third.output
    assert "Traceback" not in third.output and "starting from scratch" not in third.output
    assert snapshot(run_dir) == before
    assert launcher.leftovers(wait=10) == []


# --- two "nodes" on one machine ---

def two_node_torchrun(node_rank: int, master: str, port: int) -> list:
    return [TORCHRUN, "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--master-addr", master, "--master-port", str(port)]


def assert_two_node_run(logdir: Path, outputs: list, spawned_reference: Path):
    run_dir = single_run_dir(logdir)
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert (environment["world_size"], environment["launcher"]) == (2, "torchrun")
    assert_each_epoch_once(run_dir, reference=spawned_reference)
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-6
    assert sum(output.count(f"finished {EPOCHS} epochs") for output in outputs) == 1, outputs


def test_two_torchrun_nodes_on_127_0_0_1_train_as_one_job(data, tmp_path, launcher, spawned_reference):
    port = free_port()
    nodes = [launcher.start([*two_node_torchrun(node, "127.0.0.1", port), SCRIPT, data, *MODEL,
                             "--epochs", EPOCHS, "--logdir", tmp_path]) for node in (1, 0)]
    for node in nodes:
        assert node.finish() == 0, node.output
    assert_two_node_run(tmp_path, [node.output for node in nodes], spawned_reference)


def can_make_network_namespaces() -> str:
    """Why two network namespaces cannot be made here, or '' when they can."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"ftprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return ""


@pytest.fixture
def two_namespaces():
    """Network namespaces A and B joined by a veth pair: [(namespace, interface, address)] for each."""
    reason = can_make_network_namespaces()
    if reason:
        pytest.skip(reason)
    suffix = uuid.uuid4().hex[:6]
    ends = [(f"ft-{suffix}-a", f"fta{suffix}", "10.231.77.1"), (f"ft-{suffix}-b", f"ftb{suffix}", "10.231.77.2")]

    def ip(*args):
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, (args, result.stderr)

    try:
        for namespace, _, _ in ends:
            ip("netns", "add", namespace)
        ip("link", "add", ends[0][1], "type", "veth", "peer", "name", ends[1][1])
        for namespace, interface, address in ends:
            ip("link", "set", interface, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield ends
    finally:
        for namespace, _, _ in ends:  # deleting a namespace also deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def interface_bytes(namespace: str, interface: str, direction: str) -> int:
    result = subprocess.run(["ip", "netns", "exec", namespace, "cat",
                             f"/sys/class/net/{interface}/statistics/{direction}_bytes"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_two_nodes_in_two_network_namespaces_train_as_one_job(data, tmp_path, launcher, spawned_reference,
                                                              two_namespaces):
    port = free_port()
    master = two_namespaces[0][2]
    # gloo finds its own address from the host name, which both namespaces share; name the interface.
    nodes = [launcher.start(["ip", "netns", "exec", namespace, *two_node_torchrun(node, master, port), SCRIPT, data,
                             *MODEL, "--epochs", EPOCHS, "--logdir", tmp_path], {"GLOO_SOCKET_IFNAME": interface})
             for node, (namespace, interface, _) in reversed(list(enumerate(two_namespaces)))]
    for node in nodes:
        assert node.finish() == 0, node.output
    assert_two_node_run(tmp_path, [node.output for node in nodes], spawned_reference)
    # The gradients crossed the veth pair: 12 all-reduces of SqueezeNet 1.0's 0.74 M float32 parameters
    # (~3 MB each way per step) are at least 12 x 3 MB in each direction.
    parameters = sum(value.numel() for value in weights(spawned_reference).values())
    for namespace, interface, _ in two_namespaces:
        for direction in ("tx", "rx"):
            assert interface_bytes(namespace, interface, direction) >= EPOCHS * STEPS_PER_EPOCH * parameters * 4 * 0.5

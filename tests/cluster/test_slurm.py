"""The batch files of run_scripts/ handed to a real Slurm cluster (issue 26): slurmctld, munged and
two slurmd nodes in network namespaces on this machine (tests/slurm_cluster.py), started once for
the module and stopped at its end, leaving nothing behind.

Each job trains imagenet_ddp.py on the CPU, two processes (one per node), on scikit-learn's digits
at 32 pixels, submitted from the repository root as the README says, with the CPU in place of GPUs:
`--gres=none --cpus-per-task=1`, GPUS_PER_NODE=1. Its results are compared with the same training
run without Slurm (torchrun, 2 processes): the same seed gives the same weights, bit for bit.

Where the machine cannot run the cluster (not root, Slurm or munge not installed, no network
namespaces) the tests are skipped with the reason; test_run_scripts.py's fake-Slurm tests still run.
On Debian: apt-get install slurm-wlm munge (.ci/run does it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.rundir import CHECKPOINT_NAME
from common.tools.netns import NETNS_DIR, remove_empty_netns_dir
from helpers import REPO, differing_tensors, free_port, is_timing_column, load_checkpoint, metrics_rows, weights
from slurm_cluster import HOSTS_FILE, TAG_VARIABLE, SigtermInterrupts, SlurmCluster, missing_reason, sweep_abandoned

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH_FILES = ["slurm_srun_per_gpu.sbatch", "slurm_torchrun.sbatch", "slurm_launch_per_node.sbatch"]
# 2 epochs of 4 steps, 8 images a step per process; validation: 90 images.
TRAINING = ["--device", "cpu", "-a", "resnet18", "--image-size", "32", "--val-resize", "32", "-b", "8", "-j", "0",
            "--io-interval", "0", "-p", "1", "--checkpoint-every", "0", "--epochs", "2", "--steps-per-epoch", "4"]
STEPS_PER_EPOCH = 4
# What a CPU stands in for: no GPUs to ask for, one core and one training process per node.
CPU_JOB = ["--gres=none", "--cpus-per-task=1", "--ntasks-per-node=1"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_reason(namespaces=True)
    if reason:
        pytest.skip(reason)
    sweep_abandoned()  # what a killed earlier run left: start() would remove it, and /etc/hosts would differ
    hosts_before, netns_dir_before = HOSTS_FILE.read_bytes(), NETNS_DIR.exists()
    with SigtermInterrupts():
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), node_count=2, cpus_per_node=2).start()
        try:
            yield cluster
        finally:
            assert cluster.stop() == []  # no process, namespace, link or /etc/hosts line left
    assert HOSTS_FILE.read_bytes() == hosts_before
    assert NETNS_DIR.exists() == netns_dir_before  # `ip netns add` makes it, and mounts it, when it is the first


@pytest.fixture(scope="module")
def one_node_cluster(tmp_path_factory):
    """The cluster of `python tests/slurm_cluster.py DIR` (docs/launching.md): this machine, one node."""
    reason = missing_reason(namespaces=False)
    if reason:
        pytest.skip(reason)
    with SigtermInterrupts():
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm1"), node_count=1, cpus_per_node=2).start()
        try:
            yield cluster
        finally:
            assert cluster.stop() == []


@pytest.fixture(autouse=True)
def nodes_up(request):
    """Every test starts with both nodes idle (a test that lost a node, or failed half-way, left it so)."""
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").wait_until_idle(timeout=90)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    from common.tools.demo_data import write_digits

    root = tmp_path_factory.mktemp("digits") / "digits"
    write_digits(root, image_size=32, val_fraction=0.05)  # 1,707 training images, 90 val
    return root


@pytest.fixture(scope="module")
def reference(digits, tmp_path_factory) -> Path:
    """The run directory of the same training without Slurm: torchrun, one node, 2 processes."""
    logdir = tmp_path_factory.mktemp("reference")
    result = subprocess.run(
        [Path(sys.executable).parent / "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "imagenet_ddp.py", digits, "--logdir", logdir, "--run-name", "reference", *TRAINING],
        cwd=REPO, env=job_environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return logdir / "reference"


def job_environment(**variables) -> dict:
    """The submitting shell: this Python's environment first on PATH (torchrun, python), no GPU,
    one thread per process (two processes share two cores)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    env.update({name: str(value) for name, value in variables.items()})
    return env


def submit(cluster: SlurmCluster, folder: Path, batch_file: str, *training: str, sbatch=(), **variables) -> int:
    """`VARIABLES sbatch SBATCH run_scripts/BATCH_FILE TRAINING` from the repository root; the job's
    output goes to FOLDER/imagenet-<job id>.out, its runs to FOLDER/runs."""
    folder.mkdir(parents=True, exist_ok=True)
    env = job_environment(LOGDIR=folder / "runs", GPUS_PER_NODE=1, **variables)
    return cluster.submit([*CPU_JOB, f"--output={folder}/%x-%j.out", *sbatch, f"run_scripts/{batch_file}", *training],
                          env=env, cwd=REPO)


def output(folder: Path, job_id) -> str:
    path = folder / f"imagenet-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    assert differing_tensors(weights(run_dir), weights(reference)) == []


def results(run_dir: Path) -> list:
    """metrics.csv's rows without their timing columns (which differ from run to run)."""
    return [{name: value for name, value in row.items() if not is_timing_column(name)} for row in metrics_rows(run_dir)]


def epochs_and_splits(run_dir: Path) -> list:
    return [(row["epoch"], row["split"], row["images"], row["steps"]) for row in results(run_dir)]


# Both epochs, each (epoch, split) once: 4 steps x 8 images x 2 processes; all 90 val images, 6 steps per process.
FULL_RUN = [("0", "train", "64", "4"), ("0", "val", "90", "6"), ("1", "train", "64", "4"), ("1", "val", "90", "6")]


@pytest.mark.parametrize("batch_file", SBATCH_FILES)
def test_each_batch_file_trains_as_the_readme_says_and_matches_a_run_without_slurm(cluster, digits, reference,
                                                                                   tmp_path, batch_file):
    """`DATA=... sbatch run_scripts/<file> <training options>` on two nodes: the job completes, its run
    directory is $LOGDIR/slurm-<job id>, world size 2 across the nodes, and weights and metrics equal
    those of the same training without Slurm."""
    job_id = submit(cluster, tmp_path, batch_file, *TRAINING, DATA=digits)
    job = cluster.wait_for_job(job_id, ENDED, timeout=300)
    log = output(tmp_path, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [run_dir.name]
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    nodes = cluster.run("scontrol", "show", "hostnames", job["NodeList"]).stdout.split()
    assert environment["world_size"] == 2 and nodes == ["nodeA", "nodeB"], log
    assert epochs_and_splits(run_dir) == FULL_RUN
    assert results(run_dir) == results(reference)
    assert_same_weights(run_dir, reference)


# The training script of the stop tests: imagenet_ddp.py itself, run through this wrapper (a test hook
# from outside; nothing in the product; tests/hooked_training.py runs it). After GATE_STEP optimizer
# steps (counted over the run, once per test: the resumed run passes through) every process waits, up
# to 3 minutes, until a signal has reached it or the test releases it, so that the signal comes
# mid-epoch however fast or slow the machine is. It notes where it waits, the signals it got, and how
# it exited.
GATED_TRAINING_SCRIPT = '''
import os, signal, sys, time

sys.path.insert(0, os.path.join(os.environ["TEST_REPO"], "tests"))
from hooked_training import NOTES, run_imagenet_ddp

rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
gate_step, steps = int(os.environ["GATE_STEP"]), [0]
install = signal.signal


def noting(signum, handler):
    if not callable(handler):
        return install(signum, handler)
    def note_then_handle(number, frame):
        (NOTES / f"got-{signal.Signals(number).name}-rank{rank}").touch()
        return handler(number, frame)
    return install(signum, note_then_handle)


def wait_at_the_gate():
    steps[0] += 1
    if steps[0] == gate_step and not (NOTES / "released").exists():
        (NOTES / f"waiting-rank{rank}").touch()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (NOTES / "released").exists():
            if list(NOTES.glob(f"got-*-rank{rank}")):
                break
            time.sleep(0.1)


signal.signal = noting
run_imagenet_ddp(after_step=wait_at_the_gate, note_exit=lambda status: (NOTES / f"exit-{status}-rank{rank}").touch())
'''


def gated_job(cluster, folder: Path, digits: Path, batch_file: str, gate_step: int, sbatch=(), **variables):
    """Submit the gated training; returns (job id, notes folder) once every process waits at the gate."""
    notes = folder / "notes"
    notes.mkdir(parents=True)
    script = folder / "gated_training.py"
    script.write_text(GATED_TRAINING_SCRIPT)
    job_id = submit(cluster, folder, batch_file, *TRAINING, sbatch=sbatch, DATA=digits, SCRIPT=script,
                    TEST_REPO=REPO, TEST_NOTES=notes, GATE_STEP=gate_step, **variables)
    wait_for(lambda: len(list(notes.glob("waiting-rank*"))) == 2 or cluster.job(job_id)["JobState"] in ENDED,
             240, lambda: output(folder, job_id))
    assert len(list(notes.glob("waiting-rank*"))) == 2, output(folder, job_id)
    return job_id, notes


def wait_for(condition, timeout: float, describe) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s:\n{describe()}")
        time.sleep(0.25)


def stop_lines(log: str, signal_name: str) -> list:
    """(epoch, step) of each "stopping at" line: one for the whole job, printed by rank 0. The processes
    agree on a stop one step after the signal (common.preemption: each step's decision combines every
    process's flags as of the step before), so a signal that reached them at the gate after N steps
    stops them at step N + 1."""
    return re.findall(rf"stopping at epoch (\d+) step (\d+)/\d+ on {signal_name}", log)


@pytest.mark.skipif(tuple(map(int, re.findall(r"\d+", torch.__version__)[:2])) < (2, 9),
                    reason="torchrun passes SIGUSR1 on to its workers from torch 2.9 (--signals-to-handle)")
def test_scancel_signal_usr1_stops_every_rank_at_one_step_requeues_once_and_resumes_to_the_same_weights(
        cluster, digits, reference, tmp_path):
    """Preemption the way Slurm warns: `scancel --signal=USR1` mid-epoch. Every process stops at the
    same step, the checkpoint holds that step, rank 0 requeues the job once, Slurm starts it again
    (same job id, same run directory), --resume auto continues from the checkpoint, and the finished
    run has every (epoch, split) once and the weights of an uninterrupted run."""
    job_id, notes = gated_job(cluster, tmp_path, digits, "slurm_torchrun.sbatch", gate_step=STEPS_PER_EPOCH + 2)
    cluster.run("scancel", "--signal=USR1", str(job_id))
    wait_for(lambda: cluster.job(job_id)["Restarts"] == "1", 120, lambda: output(tmp_path, job_id))
    (notes / "released").touch()
    job = cluster.wait_for_job(job_id, ENDED, timeout=300)
    log = output(tmp_path, job_id)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), log
    assert sorted(path.name for path in notes.glob("got-*")) == ["got-SIGUSR1-rank0", "got-SIGUSR1-rank1"]
    assert sorted(path.name for path in notes.glob("exit-*")) == ["exit-75-rank0", "exit-75-rank1"], log
    assert stop_lines(log, "SIGUSR1") == [("1", "3")], log  # one step after the gate (see stop_lines)
    assert log.count(f"requeued Slurm job {job_id}") == 1 and log.count(f"job {job_id} (start 2)") == 1, log
    assert re.search(r"--resume auto: continuing \S+ \(epoch 1 after 3 steps\b", log), log
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    assert epochs_and_splits(run_dir) == FULL_RUN
    assert_same_weights(run_dir, reference)


def test_scancel_stops_with_a_checkpoint_and_no_requeue(cluster, digits, tmp_path):
    """`scancel <job>` (SIGTERM to every process, srun starting them directly): a checkpoint at the step
    every process stopped at, exit status 75, and the job is not requeued: it ends CANCELLED."""
    job_id, notes = gated_job(cluster, tmp_path, digits, "slurm_srun_per_gpu.sbatch", gate_step=2)
    cluster.run("scancel", str(job_id))
    job = cluster.wait_for_job(job_id, ENDED, timeout=120)
    log = output(tmp_path, job_id)
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), log
    assert stop_lines(log, "SIGTERM") == [("0", "3")], log
    assert sorted(path.name for path in notes.glob("exit-*")) == ["exit-75-rank0", "exit-75-rank1"], log
    state = load_checkpoint(tmp_path / "runs" / f"slurm-{job_id}" / CHECKPOINT_NAME)
    assert (state["epoch"], state["step"]) == (0, 3)
    assert "requeued Slurm job" not in log


def test_the_wall_time_warning_from_slurm_itself_checkpoints_and_requeues(cluster, digits, tmp_path):
    """`sbatch --time=2 --signal=USR1@60`: Slurm itself sends SIGUSR1 a minute before the limit (its
    timer looks every 30 s: 30 to 60 s into the job). The processes stop at one step with a
    checkpoint and the job is requeued before the limit, to start again from that checkpoint."""
    job_id, notes = gated_job(cluster, tmp_path, digits, "slurm_srun_per_gpu.sbatch", gate_step=1,
                              sbatch=["--time=2", "--signal=USR1@60"], SIGNAL_WARNING_SECONDS=60)
    wait_for(lambda: cluster.job(job_id)["Restarts"] == "1", 150, lambda: output(tmp_path, job_id))
    cluster.run("scancel", str(job_id))  # its second start is the first test's business
    log = output(tmp_path, job_id)
    assert sorted(path.name for path in notes.glob("got-*")) == ["got-SIGUSR1-rank0", "got-SIGUSR1-rank1"], log
    assert stop_lines(log, "SIGUSR1") == [("0", "2")], log
    assert log.count(f"requeued Slurm job {job_id}") == 1, log
    state = load_checkpoint(tmp_path / "runs" / f"slurm-{job_id}" / CHECKPOINT_NAME)
    assert (state["epoch"], state["step"]) == (0, 2)


def test_a_lost_node_requeues_the_job_and_a_resubmission_continues_from_the_newest_checkpoint(
        cluster, digits, reference, tmp_path):
    """Mid-epoch 1 the second node dies (its slurmd and every process on it). Slurm notices within
    seconds (SlurmdTimeout=10), ends the job's allocation and requeues it (--requeue); it cannot start
    with one node of two. Cancelled, then submitted again with RUN_NAME=slurm-<old id> on both nodes
    (the lost one back), the run continues from the end of epoch 0 to the uninterrupted run's weights."""
    job_id, notes = gated_job(cluster, tmp_path, digits, "slurm_torchrun.sbatch", gate_step=STEPS_PER_EPOCH + 2)
    lost = cluster.nodes[1]
    cluster.lose_node(lost)
    (notes / "released").touch()
    def requeued_or_ended():
        job = cluster.job(job_id)
        return (job["Restarts"], job["JobState"]) == ("1", "PENDING") or job["JobState"] in ENDED

    wait_for(requeued_or_ended, 120, lambda: f"{cluster.job(job_id)}\n{output(tmp_path, job_id)}")
    job = cluster.job(job_id)
    assert (job["Restarts"], job["JobState"]) == ("1", "PENDING"), (job, output(tmp_path, job_id))
    assert cluster.node_states()[lost.name].rstrip("*") in ("down", "idle+down"), cluster.node_states()
    cluster.run("scancel", str(job_id))

    cluster.wait_until_idle(timeout=90)  # the node comes back
    again = submit(cluster, tmp_path, "slurm_torchrun.sbatch", *TRAINING, DATA=digits, RUN_NAME=f"slurm-{job_id}")
    job = cluster.wait_for_job(again, ENDED, timeout=300)
    log = output(tmp_path, again)
    assert job["JobState"] == "COMPLETED", log
    assert re.search(r"--resume auto: continuing \S+checkpoint\S* \(epoch 1\b", log), log
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    assert epochs_and_splits(run_dir) == FULL_RUN
    assert_same_weights(run_dir, reference)


def test_each_task_of_a_job_array_gets_its_own_run_directory(one_node_cluster, digits, tmp_path):
    """`sbatch --array=0-1 --nodes=1` on the one-node cluster: the two tasks run side by side on its
    two CPUs, each in runs/slurm-<array job id>_<task id>."""
    cluster = one_node_cluster
    job_id = submit(cluster, tmp_path, "slurm_srun_per_gpu.sbatch", *TRAINING, "--epochs", "1", "--steps-per-epoch", "1",
                    sbatch=["--array=0-1", "--nodes=1"], DATA=digits)
    tasks = [cluster.wait_for_job(f"{job_id}_{task}", ENDED, timeout=300) for task in (0, 1)]
    logs = [output(tmp_path, task["JobId"]) for task in tasks]
    assert [task["JobState"] for task in tasks] == ["COMPLETED", "COMPLETED"], logs
    assert tasks[1]["StartTime"] <= tasks[0]["EndTime"]  # side by side (ISO times, to the second)
    run_dirs = sorted(path.name for path in (tmp_path / "runs").iterdir())
    assert run_dirs == [f"slurm-{job_id}_0", f"slurm-{job_id}_1"]
    for name in run_dirs:  # one process each: 1 step of 8 images; all 90 val images in 12 steps
        assert epochs_and_splits(tmp_path / "runs" / name) == [("0", "train", "8", "1"), ("0", "val", "90", "12")]


def test_a_later_run_sweeps_away_what_a_killed_test_run_left_behind(tmp_path):
    """A test run killed with SIGKILL cannot stop its cluster. The next cluster's start removes what
    it left, found by the tag that names its owner's PID, now gone: a process of the cluster, a
    namespace, a bridge and an /etc/hosts line; a live owner's are kept."""
    reason = missing_reason(namespaces=True)
    if reason:
        pytest.skip(reason)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive = f"imn{gone.pid}a", f"imn{os.getpid()}z"
    hosts_before, netns_dir_before = HOSTS_FILE.read_text(), NETNS_DIR.exists()
    sleeper = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **{TAG_VARIABLE: dead}))
    try:
        for tag in (dead, alive):
            subprocess.run(["ip", "netns", "add", f"{tag}n0"], check=True)
            subprocess.run(["ip", "link", "add", f"{tag}br", "type", "bridge"], check=True)
        with open(HOSTS_FILE, "a") as hosts:
            hosts.write(f"10.213.250.11 nodeA  # {dead} test Slurm cluster\n10.213.250.12 nodeA  # {alive} test Slurm cluster\n")
        removed = sweep_abandoned()
        assert sorted(removed) == sorted([f"process {sleeper.pid}", f"namespace {dead}n0", f"link {dead}br",
                                          f"/etc/hosts line '10.213.250.11 nodeA  # {dead} test Slurm cluster'"])
        assert sleeper.wait(timeout=10) == -9
        assert f"{alive}n0" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert HOSTS_FILE.read_text() == hosts_before + f"10.213.250.12 nodeA  # {alive} test Slurm cluster\n"
    finally:
        sleeper.kill()
        for tag in (dead, alive):
            subprocess.run(["ip", "netns", "delete", f"{tag}n0"], capture_output=True)
            subprocess.run(["ip", "link", "delete", f"{tag}br"], capture_output=True)
        HOSTS_FILE.write_text(hosts_before)
        if not netns_dir_before:
            remove_empty_netns_dir()

"""run_scripts/: every shell file parses (and passes shellcheck where it is installed); the
Slurm batch files, run by bash with stand-ins for srun, scontrol and torchrun, start exactly the
commands they promise; launch_nodes.py prints the exact per-node commands, refuses mistakes with
one line, and with --run (through a local stand-in for ssh) runs them, stops the others when one
fails, and trains a real two-node job."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.launcher import first_slurm_host, slurm_port
from helpers import REPO, free_port, load_checkpoint, make_image_folder, metrics_rows

RUN_SCRIPTS = REPO / "run_scripts"
SHELL_FILES = sorted(RUN_SCRIPTS.glob("*.sh")) + sorted(RUN_SCRIPTS.glob("*.sbatch"))
SBATCH_FILES = sorted(RUN_SCRIPTS.glob("*.sbatch"))
LAUNCH_NODES = RUN_SCRIPTS / "launch_nodes.py"

JOB_ID = 1234567  # above 20000, so the port shows the modulo: 10000 + 1234567 % 20000 = 24567
NODELIST = "gpu[07-08]"
SIGNALS_FOR_TORCHRUN = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def test_the_expected_files_are_there():
    # The parametrised checks below would pass vacuously on an empty folder.
    assert {"demo.sh", "gpu_demo_matrix.sh", "gpu_check.sh", "slurm_launch_per_node.sbatch", "slurm_srun_per_gpu.sbatch",
            "slurm_torchrun.sbatch"} <= {path.name for path in SHELL_FILES}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run its 10 trainings")
def test_the_gpu_demo_matrix_stops_at_once_without_a_gpu(tmp_path):
    result = subprocess.run(["bash", RUN_SCRIPTS / "gpu_demo_matrix.sh"], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "LOGDIR": str(tmp_path / "runs")})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"gpu_demo_matrix.sh: error: no CUDA GPU is visible to {sys.executable}"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run its parts")
def test_the_gpu_check_stops_at_once_without_a_gpu(tmp_path):
    result = subprocess.run(["bash", RUN_SCRIPTS / "gpu_check.sh", "tests"], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
                                 "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"gpu_check.py: error: no CUDA GPU is visible to {sys.executable} (torch.cuda.is_available() is False); "
        f"--dry-run shows what would run"]
    assert not (tmp_path / "out").exists()


# --- syntax ---

@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: path.name)
def test_shell_file_parses(path):
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: path.name)
def test_shell_file_passes_shellcheck(path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "--shell=bash", path], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("path", SBATCH_FILES, ids=lambda path: path.name)
def test_sbatch_file_asks_for_preemption_handling(path):
    lines = path.read_text().splitlines()
    # sbatch stops reading #SBATCH lines at the first command: a later one would be silently ignored.
    first_command = next(index for index, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    options = [line.split("#")[1].split()[1] for line in lines if line.startswith("#SBATCH")]
    assert all(index < first_command for index, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert "--signal=USR1@180" in options and "--requeue" in options and "--open-mode=append" in options
    assert any(option.startswith("--nodes=") for option in options)
    text = path.read_text()
    assert "--resume auto" in text and "SCRIPT=${SCRIPT:-imagenet_ddp.py}" in text and "DATA=${DATA:-" in text


# --- the Slurm batch files, with stand-ins for Slurm and torchrun ---

RECORDED_ENV = ["PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "SRUN_CPUS_PER_TASK", "SLURM_NODEID"]

FAKE_SRUN = '''
"""Stand-in for srun: records its arguments. FAKE_SRUN_BARRIER: every step waits until all have
started (so steps run one after another fail). FAKE_SRUN_STATUS=host=code: the step on that host
exits with code. FAKE_SRUN_EXEC: run the command as srun would, one process per task here."""
import json, os, subprocess, sys, time
from pathlib import Path

options, command = [], sys.argv[1:]
while command and command[0].startswith("-"):
    options.append(command.pop(0))
option = dict(item.lstrip("-").split("=", 1) for item in options if "=" in item)
record(["srun", *sys.argv[1:]])
if os.environ.get("FAKE_SRUN_BARRIER"):
    barrier = Path(os.environ["FAKE_SRUN_BARRIER"])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 20
    while len(list(barrier.iterdir())) < int(os.environ["FAKE_SRUN_STEPS"]):
        if time.monotonic() > deadline:
            sys.exit("srun stand-in: the other steps did not start alongside this one")
        time.sleep(0.05)
statuses = dict(item.split("=") for item in os.environ.get("FAKE_SRUN_STATUS", "").split(",") if item)
if option.get("nodelist") in statuses:
    sys.exit(int(statuses[option["nodelist"]]))
if os.environ.get("FAKE_SRUN_EXEC"):
    nodes = 1 if option.get("nodes") == "1" else int(os.environ["SLURM_JOB_NUM_NODES"])
    per_node = int(option.get("ntasks-per-node", 1))
    tasks = []
    for node in range(nodes):
        for local in range(per_node):
            env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                       SLURM_NODEID=str(node), SLURM_STEP_NUM_TASKS=str(nodes * per_node),
                       SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                       SLURM_NTASKS=str(nodes * per_node))
            tasks.append(subprocess.Popen(command, env=env))
    codes = [task.wait() for task in tasks]
    sys.exit(next((code for code in codes if code), 0))
'''

FAKE_SCONTROL = '''
"""Stand-in for scontrol: records its arguments; `show hostnames LIST` expands a simple hostlist."""
import re, sys

record(["scontrol", *sys.argv[1:]])
if sys.argv[1:3] == ["show", "hostnames"]:
    for entry in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?[^,]*", sys.argv[3]):
        match = re.fullmatch(r"(.*)\\[(.*)\\](.*)", entry)
        if not match:
            print(entry)
            continue
        for part in match.group(2).split(","):
            low, _, high = part.partition("-")
            for number in range(int(low), int(high or low) + 1):
                print(f"{match.group(1)}{number:0{len(low)}d}{match.group(3)}")
'''

FAKE_TORCHRUN = '''
"""Stand-in for torchrun: records its arguments and the signal variables it was given."""
import sys

record(["torchrun", *sys.argv[1:]])
'''

RECORDER = f'''#!{sys.executable}
import json, os

def record(argv):
    environment = {{name: os.environ[name] for name in {RECORDED_ENV!r} if name in os.environ}}
    with open(os.environ["FAKE_CALLS"], "a") as log:
        log.write(json.dumps({{"argv": argv, "env": environment}}) + "\\n")
'''


@pytest.fixture
def fake_slurm(tmp_path):
    """A bin folder with srun, scontrol and torchrun stand-ins; returns (bin, calls file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", FAKE_TORCHRUN)):
        path = bin_dir / name
        path.write_text(RECORDER + body)
        path.chmod(0o755)
    return bin_dir, tmp_path / "calls.jsonl"


def slurm_environment(bin_dir: Path, calls: Path, **extra) -> dict:
    """The batch shell's environment on a 2-node job, with nothing inherited from a real Slurm job."""
    script_variables = {"SCRIPT", "DATA", "PYTHON", "LOGDIR", "GPUS_PER_NODE", "RUN_NAME", "PORT", "MAX_RESTARTS",
                        "PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "SRUN_CPUS_PER_TASK",
                        "SIGNAL_WARNING_SECONDS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"}
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("SLURM_") and name not in script_variables}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_CALLS=str(calls),
               SLURM_JOB_ID=str(JOB_ID), SLURM_JOB_NODELIST=NODELIST, SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
               SLURM_CPUS_PER_TASK="32", SCRIPT="imagenet_ddp_apex.py", DATA="/data/image net", PYTHON="python3")
    env.update({name: str(value) for name, value in extra.items()})
    return env


def run_batch_file(name: str, env: dict, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", RUN_SCRIPTS / name, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def recorded(calls: Path, program: str):
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [call for call in map(json.loads, lines) if call["argv"][0] == program]


PORT = slurm_port(JOB_ID)
MASTER = first_slurm_host(NODELIST)
TRAINING_ARGS = ["imagenet_ddp_apex.py", "/data/image net", "--logdir", "runs", "--run-name", f"slurm-{JOB_ID}",
                 "--resume", "auto", "-a", "resnet50", "--opt-level", "O2"]


def test_the_port_and_master_are_those_the_training_script_derives():
    assert (PORT, MASTER) == (24567, "gpu07")


def test_launch_per_node_starts_one_launcher_per_node_at_once(fake_slurm, tmp_path):
    bin_dir, calls = fake_slurm
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = slurm_environment(bin_dir, calls, FAKE_SRUN_BARRIER=barrier, FAKE_SRUN_STEPS=2)
    result = run_batch_file("slurm_launch_per_node.sbatch", env, "-a", "resnet50", "--opt-level", "O2")
    assert result.returncode == 0, result.stderr
    assert [call["argv"] for call in recorded(calls, "scontrol")] == [["scontrol", "show", "hostnames", NODELIST]]
    steps = sorted(recorded(calls, "srun"), key=lambda call: call["argv"][3])  # by --nodelist
    assert [call["argv"] for call in steps] == [
        ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "python3", "-m", "torch.distributed.launch",
         "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=4", f"--master_addr={MASTER}",
         f"--master_port={PORT}", *TRAINING_ARGS] for rank, host in enumerate(["gpu07", "gpu08"])]
    for step in steps:
        assert step["env"] == {"PET_SIGNALS_TO_HANDLE": SIGNALS_FOR_TORCHRUN,
                               "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_FOR_TORCHRUN,
                               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "150", "SRUN_CPUS_PER_TASK": "32"}
    assert f"2 nodes (gpu07 gpu08) x 4 GPUs, imagenet_ddp_apex.py, nodes meet at gpu07:{PORT}" in result.stdout


@pytest.mark.parametrize("statuses, expected", [("gpu08=3", 3), ("gpu07=1,gpu08=75", 1), ("gpu08=75", 75)])
def test_launch_per_node_exits_with_the_first_failing_nodes_status(fake_slurm, statuses, expected):
    bin_dir, calls = fake_slurm
    result = run_batch_file("slurm_launch_per_node.sbatch",
                            slurm_environment(bin_dir, calls, FAKE_SRUN_STATUS=statuses))
    assert result.returncode == expected
    failed = dict(item.split("=") for item in statuses.split(","))
    assert result.stderr.splitlines() == [
        f"slurm_launch_per_node.sbatch: node {rank} ({host}) exited with status {failed[host]}"
        for rank, host in enumerate(["gpu07", "gpu08"]) if host in failed]
    assert len(recorded(calls, "srun")) == 2  # a failing node does not keep the other from starting


def test_torchrun_runs_the_same_rendezvous_command_on_every_node(fake_slurm):
    bin_dir, calls = fake_slurm
    env = slurm_environment(bin_dir, calls, FAKE_SRUN_EXEC=1, MAX_RESTARTS=5)
    result = run_batch_file("slurm_torchrun.sbatch", env, "-a", "resnet50", "--opt-level", "O2")
    assert result.returncode == 0, result.stderr
    torchrun = ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{MASTER}:{PORT}", "--rdzv-id", str(JOB_ID), "--max-restarts", "5",
                *TRAINING_ARGS]
    assert [call["argv"] for call in recorded(calls, "srun")] == [["srun", "--ntasks-per-node=1", *torchrun]]
    started = sorted(recorded(calls, "torchrun"), key=lambda call: call["env"]["SLURM_NODEID"])
    assert [call["argv"] for call in started] == [torchrun, torchrun]
    assert [call["env"] for call in started] == [
        {"PET_SIGNALS_TO_HANDLE": SIGNALS_FOR_TORCHRUN, "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_FOR_TORCHRUN,
         "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "150", "SRUN_CPUS_PER_TASK": "32", "SLURM_NODEID": str(node)}
        for node in (0, 1)]


def test_torchrun_restarts_three_times_by_default(fake_slurm):
    bin_dir, calls = fake_slurm
    result = run_batch_file("slurm_torchrun.sbatch", slurm_environment(bin_dir, calls))
    assert result.returncode == 0, result.stderr
    argv = recorded(calls, "srun")[0]["argv"]
    assert argv[argv.index("--max-restarts") + 1] == "3"


TORCHRUN_SBATCH_FILES = ["slurm_torchrun.sbatch", "slurm_launch_per_node.sbatch"]


@pytest.mark.parametrize("name", TORCHRUN_SBATCH_FILES)
@pytest.mark.parametrize("variables, seconds", [
    ({}, "150"),  # the file's own --signal=USR1@180, less 30 s for torchrun and srun to end
    ({"SIGNAL_WARNING_SECONDS": 600}, "570"),  # sbatch --signal=USR1@600
    ({"SIGNAL_WARNING_SECONDS": 40}, "20"),  # a short warning: half of it
])
def test_torchrun_waits_for_its_workers_until_shortly_before_slurms_kill(fake_slurm, name, variables, seconds):
    bin_dir, calls = fake_slurm
    result = run_batch_file(name, slurm_environment(bin_dir, calls, **variables))
    assert result.returncode == 0, result.stderr
    started = recorded(calls, "srun")  # srun passes its environment on to the torchrun it starts
    assert started and all(call["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == seconds for call in started)
    # An environment variable, not torchrun's --shutdown-timeout: a torchrun without it would refuse the flag.
    assert not any("shutdown" in argument for call in started for argument in call["argv"])


@pytest.mark.parametrize("name", TORCHRUN_SBATCH_FILES)
def test_the_warning_time_default_is_the_one_sbatch_is_asked_for(name):
    text = (RUN_SCRIPTS / name).read_text()
    asked = re.search(r"^#SBATCH --signal=USR1@(\d+)\b", text, re.MULTILINE).group(1)
    default = re.search(r"^SIGNAL_WARNING_SECONDS=\$\{SIGNAL_WARNING_SECONDS:-(\d+)\}", text, re.MULTILINE).group(1)
    assert default == asked == "180"

def test_srun_per_gpu_starts_one_task_per_gpu(fake_slurm):
    bin_dir, calls = fake_slurm
    result = run_batch_file("slurm_srun_per_gpu.sbatch", slurm_environment(bin_dir, calls),
                            "-a", "resnet50", "--opt-level", "O2")
    assert result.returncode == 0, result.stderr
    srun = recorded(calls, "srun")
    assert [call["argv"] for call in srun] == [["srun", "--ntasks-per-node=4", "python3", *TRAINING_ARGS]]
    assert srun[0]["env"] == {"SRUN_CPUS_PER_TASK": "32"}  # no torchrun to tell about signals
    assert recorded(calls, "scontrol") == []  # the training processes find the first host themselves


@pytest.mark.parametrize("name", [path.name for path in SBATCH_FILES])
def test_an_array_task_gets_its_own_run_directory(fake_slurm, name):
    bin_dir, calls = fake_slurm
    env = slurm_environment(bin_dir, calls, SLURM_ARRAY_JOB_ID=JOB_ID - 7, SLURM_ARRAY_TASK_ID=7)
    assert run_batch_file(name, env).returncode == 0
    for call in recorded(calls, "srun"):
        argv = call["argv"]
        assert argv[argv.index("--run-name") + 1] == f"slurm-{JOB_ID - 7}_7"


@pytest.mark.parametrize("name", [path.name for path in SBATCH_FILES])
def test_variables_replace_the_defaults(fake_slurm, name):
    bin_dir, calls = fake_slurm
    env = slurm_environment(bin_dir, calls, RUN_NAME="resnet50-long", LOGDIR="/scratch/runs", GPUS_PER_NODE=8,
                            PORT=29400)
    assert run_batch_file(name, env).returncode == 0
    (call,) = [call for call in recorded(calls, "srun") if "--nodelist=gpu08" not in call["argv"]]
    argv = " ".join(call["argv"])
    assert "--logdir /scratch/runs --run-name resnet50-long --resume auto" in argv
    assert {"slurm_launch_per_node.sbatch": "--nproc_per_node=8 --master_addr=gpu07 --master_port=29400",
            "slurm_torchrun.sbatch": "--nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu07:29400",
            "slurm_srun_per_gpu.sbatch": "--ntasks-per-node=8 python3"}[name] in argv


@pytest.mark.parametrize("name", [path.name for path in SBATCH_FILES])
def test_outside_a_slurm_job_the_batch_file_says_how_to_submit_it(fake_slurm, name):
    bin_dir, calls = fake_slurm
    env = slurm_environment(bin_dir, calls)
    del env["SLURM_JOB_ID"]
    result = run_batch_file(name, env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"{name}: error: SLURM_JOB_ID is not set: submit this file with sbatch"]
    assert not calls.exists()


# Tiny CPU training: 3 classes, 8 training images each, 2 steps of 4 images per process.
TINY_TRAINING = ["--device", "cpu", "-a", "squeezenet1_0", "--io-interval", "0", "-j", "0", "--image-size", "32",
                 "--val-resize", "32", "-b", "4", "--epochs", "1", "--steps-per-epoch", "2"]


def epoch_rows(run_dir: Path):
    return [(row["epoch"], row["split"], row["images"], row["steps"]) for row in metrics_rows(run_dir)]


@pytest.mark.slow
def test_srun_per_gpu_trains_for_real(fake_slurm, tmp_path):
    """The batch file's command, started as srun would start 2 tasks on one node, trains."""
    bin_dir, calls = fake_slurm
    data = make_image_folder(tmp_path / "data")
    job_id = free_port(10000, 30000) - 10000 + 3 * 20000  # its derived port is free here
    env = slurm_environment(bin_dir, calls, FAKE_SRUN_EXEC=1, SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost",
                            SLURM_JOB_NUM_NODES=1, SLURM_NNODES=1, GPUS_PER_NODE=2, SCRIPT="imagenet_ddp.py",
                            PYTHON=sys.executable, DATA=data, LOGDIR=tmp_path / "runs", CUDA_VISIBLE_DEVICES="",
                            OMP_NUM_THREADS=1)
    result = run_batch_file("slurm_srun_per_gpu.sbatch", env, *TINY_TRAINING)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    assert epoch_rows(run_dir) == [("0", "train", "16", "2"), ("0", "val", "9", "2")]  # 2 steps x 4 x 2 processes; 5 + 4 val images
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert (environment["launcher"], environment["world_size"]) == ("slurm", 2)



# The training script under torchrun in the test below: imagenet_ddp.py itself, with two test hooks
# from outside (none in the product; tests/hooked_training.py runs it). After its first optimizer step
# it sends SIGUSR1 to its parent, torchrun, as Slurm's warning would (torchrun passes it back to it);
# each checkpoint write sleeps SLOW_SAVE_SECONDS between writing the temporary file and renaming it, as
# a slow shared file system would. It notes when that write began and the status it exits with.
SLOW_SAVER = '''
import os, signal, sys, time

sys.path.insert(0, os.path.join(os.environ["TEST_REPO"], "tests"))
from hooked_training import NOTES, run_imagenet_ddp
from common import rundir

atomic_write = rundir.atomic_write


def slow_atomic_write(path, write):
    def write_slowly(handle):
        write(handle)
        if path.name.endswith(".pth.tar"):
            (NOTES / "save-began").touch()
            time.sleep(float(os.environ["SLOW_SAVE_SECONDS"]))
    atomic_write(path, write_slowly)


def warn_once():
    if not (NOTES / "signalled").exists():
        (NOTES / "signalled").touch()
        os.kill(os.getppid(), signal.SIGUSR1)


rundir.atomic_write = slow_atomic_write
run_imagenet_ddp(after_step=warn_once, note_exit=lambda status: (NOTES / "exit-status").write_text(str(status)))
'''
SLOW_SAVE_SECONDS = 6
# 6 steps an epoch (24 images, 4 a step, 1 process): the signal after step 1 stops it within epoch 0.
STOPPABLE_TRAINING = [*TINY_TRAINING[:TINY_TRAINING.index("--epochs")], "--epochs", "2", "--checkpoint-every", "0"]


def stop_with_a_slow_checkpoint(fake_slurm, folder: Path, data: Path, **variables) -> tuple:
    """Run slurm_torchrun.sbatch (1 node, 1 CPU process, a real torchrun) with the slow saver as its
    script; returns (batch file's result, its output, run directory, notes folder, requeue calls)."""
    bin_dir, calls = fake_slurm
    if not (bin_dir / "torchrun").is_symlink():
        (bin_dir / "torchrun").unlink()
        (bin_dir / "torchrun").symlink_to(Path(sys.executable).parent / "torchrun")
    folder.mkdir()
    wrapper, notes = folder / "slow_saver.py", folder / "notes"
    wrapper.write_text(SLOW_SAVER)
    notes.mkdir()
    job_id = free_port(10000, 30000) - 10000 + 3 * 20000  # its derived port is free here
    env = slurm_environment(bin_dir, calls, FAKE_SRUN_EXEC=1, SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost",
                            SLURM_JOB_NUM_NODES=1, SLURM_NNODES=1, GPUS_PER_NODE=1, SCRIPT=wrapper, DATA=data,
                            LOGDIR=folder / "runs", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=1, TEST_REPO=REPO,
                            TEST_NOTES=notes, SLOW_SAVE_SECONDS=SLOW_SAVE_SECONDS, **variables)
    result = run_batch_file("slurm_torchrun.sbatch", env, *STOPPABLE_TRAINING)
    output = result.stdout + result.stderr
    requeues = [call["argv"][1:] for call in recorded(calls, "scontrol")
                if call["argv"][1] == "requeue" and call["argv"][2] == str(job_id)]
    assert (notes / "signalled").exists() and (notes / "save-began").exists(), output
    return result, output, folder / "runs" / f"slurm-{job_id}", notes, requeues


@pytest.mark.slow
def test_torchrun_gives_a_slow_checkpoint_the_warning_time(fake_slurm, tmp_path):
    """slurm_torchrun.sbatch under a real torchrun on the CPU: SIGUSR1 reaches the training process,
    whose checkpoint takes SLOW_SAVE_SECONDS to write. With a 4 s warning (SIGNAL_WARNING_SECONDS=4)
    torchrun kills it 2 s after passing the signal on, in the middle of the write: the batch file's
    setting reaches torchrun, whose own default is 30 s. With the default 180 s warning torchrun
    waits 150 s: the checkpoint is written whole, the job requeued, and the process exits with 75."""
    data = make_image_folder(tmp_path / "data")

    result, output, run_dir, notes, requeues = stop_with_a_slow_checkpoint(
        fake_slurm, tmp_path / "short", data, SIGNAL_WARNING_SECONDS=4)
    assert not (notes / "exit-status").exists(), output  # killed: no exit of its own
    assert not (run_dir / "checkpoint.pth.tar").exists() and not list(run_dir.glob("checkpoint-*")), output
    assert requeues == [] and result.returncode != 0

    result, output, run_dir, notes, requeues = stop_with_a_slow_checkpoint(fake_slurm, tmp_path / "default", data)
    assert (notes / "exit-status").read_text() == "75", output  # stopped with its checkpoint: run again
    stop = re.search(r"stopping at epoch 0 step (\d+)/6 on SIGUSR1", output)
    state = load_checkpoint(run_dir / "checkpoint.pth.tar")
    assert stop and (state["epoch"], state["step"]) == (0, int(stop.group(1))), output
    assert requeues == [["requeue", run_dir.name.removeprefix("slurm-")]]
    assert result.returncode == 1  # torchrun's own status after passing a signal on (docs/faults.md)


# --- launch_nodes.py: printing ---

def launch_nodes(*args, timeout: float = 120, env: dict | None = None, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LAUNCH_NODES, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_per_node_commands_for_three_hosts():
    result = launch_nodes("--hosts", "node1,node2,node3", "--workdir", "/srv/imagenet trainer", "--",
                          "imagenet_ddp.py", "-a", "resnet50", "/data/image net")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        "# node 0 of 3: node1, where the others meet",
        "cd '/srv/imagenet trainer' && python imagenet_ddp.py --dist-url tcp://node1:29500 --world-size 3 "
        "--rank 0 -a resnet50 '/data/image net'",
        "# node 1 of 3: node2",
        "cd '/srv/imagenet trainer' && python imagenet_ddp.py --dist-url tcp://node1:29500 --world-size 3 "
        "--rank 1 -a resnet50 '/data/image net'",
        "# node 2 of 3: node3",
        "cd '/srv/imagenet trainer' && python imagenet_ddp.py --dist-url tcp://node1:29500 --world-size 3 "
        "--rank 2 -a resnet50 '/data/image net'",
    ]


def test_torchrun_commands_for_three_hosts():
    result = launch_nodes("--hosts", "node1,node2,node3", "--style", "torchrun", "--port", "23456", "--workdir",
                          "/srv/trainer", "--", "imagenet_ddp_apex.py", "-a", "resnet50", "--opt-level", "O2", "/data")
    assert result.returncode == 0 and result.stderr == ""
    commands = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert commands == [
        f"cd /srv/trainer && torchrun --nnodes 3 --node-rank {rank} --nproc-per-node gpu --master-addr node1 "
        f"--master-port 23456 imagenet_ddp_apex.py -a resnet50 --opt-level O2 /data" for rank in range(3)]


def test_python_and_processes_per_node_for_both_styles():
    common = ["--hosts", "10.0.0.1,10.0.0.2", "--workdir", "/w", "--python", "/opt/venv/bin/python",
              "--nproc-per-node", "2"]
    per_node = launch_nodes(*common, "--", "imagenet_ddp.py", "DATA").stdout.splitlines()[1]
    assert per_node == ("cd /w && /opt/venv/bin/python imagenet_ddp.py --dist-url tcp://10.0.0.1:29500 "
                        "--world-size 2 --rank 0 --nproc-per-node 2 DATA")
    torchrun = launch_nodes(*common, "--style", "torchrun", "--", "imagenet_ddp.py", "DATA").stdout.splitlines()[3]
    assert torchrun == ("cd /w && /opt/venv/bin/python -m torch.distributed.run --nnodes 2 --node-rank 1 "
                        "--nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 imagenet_ddp.py DATA")


def test_an_ipv6_node_zero_is_bracketed_in_the_url():
    result = launch_nodes("--hosts", "fd00::1,fd00::2", "--workdir", "/w", "--", "imagenet_ddp.py", "DATA")
    assert "--dist-url 'tcp://[fd00::1]:29500' --world-size 2 --rank 1 DATA" in result.stdout.splitlines()[3]


def test_a_hostfile_gives_the_same_commands_as_hosts(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# the machines of the lab\nnode1 slots=4\n\n  node2   # the new one\nnode3\n")
    from_file = launch_nodes("--hostfile", hostfile, "--workdir", "/w", "--", "imagenet_ddp.py", "DATA")
    from_flag = launch_nodes("--hosts", "node1,node2,node3", "--workdir", "/w", "--", "imagenet_ddp.py", "DATA")
    assert from_file.returncode == 0 and from_file.stdout == from_flag.stdout
    assert from_file.stdout.count("--world-size 3") == 3


@pytest.mark.parametrize("args, message", [
    (["--", "imagenet_ddp.py"], "no hosts: give --hosts H0,H1,... or --hostfile FILE"),
    (["--hosts", ",", "--", "x.py"], "argument --hosts: no hosts given (e.g. --hosts node1,node2)"),
    (["--hosts", "a,,b", "--", "x.py"], "argument --hosts: empty host name in 'a,,b'"),
    (["--hosts", "a,b,a", "--", "x.py"],
     "argument --hosts: a is listed twice (one command per node; --nproc-per-node sets the processes of each)"),
    (["--hosts=-oProxyCommand=evil", "--", "x.py"],
     "argument --hosts: '-oProxyCommand=evil' is not a host name or address"),
    (["--hostfile", "/no/such/hosts.txt", "--", "x.py"],
     "argument --hostfile: cannot read /no/such/hosts.txt (No such file or directory)"),
    (["--hosts", "a", "--hostfile", "h", "--", "x.py"],
     "argument --hostfile: not allowed with --hosts (give the nodes one way)"),
    (["--hosts", "a,b"], "no training script after -- (e.g. -- imagenet_ddp.py -a resnet50 /data/imagenet)"),
    (["--hosts", "a,b", "--"], "no training script after -- (e.g. -- imagenet_ddp.py -a resnet50 /data/imagenet)"),
    (["--hosts", "a,b", "imagenet_ddp.py", "DATA"],
     "unrecognized arguments: imagenet_ddp.py DATA (the training script and its arguments go after --)"),
    (["--hosts", "a", "--", "-a", "resnet50"], "expected the training script right after --, got '-a'"),
    (["--hosts", "a", "--", "x.py", "--rank", "1"],
     "--rank after --: this launcher sets it for each node (use --hosts (their order))"),
    (["--hosts", "a", "--", "x.py", "--dist-url=tcp://a:1"],
     "--dist-url after --: this launcher sets it for each node (use --hosts (node 0) and --port)"),
    (["--hosts", "a", "--port", "65536", "--", "x.py"], "argument --port: 65536 is not a port number (1 to 65535)"),
    (["--hosts", "a", "--nproc-per-node", "0", "--", "x.py"],
     "argument --nproc-per-node: 0 is not a positive number"),
    (["--hosts", "a", "--style", "mpi", "--", "x.py"],
     "argument --style: invalid choice: 'mpi' (choose from 'per-node', 'torchrun') (see --help)"),
    (["--hosts", "a", "--run", "--ssh", "", "--", "x.py"], "argument --ssh: empty command"),
])
def test_launch_nodes_mistakes_get_one_line_and_status_2(args, message):
    result = launch_nodes(*args)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"launch_nodes.py: error: {message}"]


def test_an_empty_hostfile_is_a_mistake(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# nobody yet\n\n")
    result = launch_nodes("--hostfile", hostfile, "--", "x.py")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"launch_nodes.py: error: argument --hostfile: {hostfile} lists no hosts"]


def test_a_hostfile_of_a_million_names_is_checked_in_linear_time(tmp_path):
    # Each name was compared with every name before it: hours for a million; a set takes about a second.
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"node{index}\n" for index in range(1_000_000)) + "node0\n")
    result = launch_nodes("--hostfile", hostfile, "--", "x.py", timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"launch_nodes.py: error: argument --hostfile: {hostfile}: node0 is listed "
                                          f"twice (one command per node; --nproc-per-node sets the processes of each)"]


# --- launch_nodes.py --run, through a stand-in for ssh that runs the command here ---

FAKE_NODE_SCRIPT = '''
"""A training script's stand-in: says who it is, waits for the others, then sleeps and exits as
--sleep and --exit-codes say for its rank."""
import os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
rank = int(os.environ["RANK"]) if "RANK" in os.environ else int(args[args.index("--rank") + 1])
world = os.environ.get("WORLD_SIZE") or args[args.index("--world-size") + 1]
value = lambda flag, default: args[args.index(flag) + 1].split(",")[rank] if flag in args else default
marker = Path(args[args.index("--markers") + 1]) / f"rank{rank}"

def stopped(signum, frame):
    marker.write_text(f"stopped by {signal.Signals(signum).name}")
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stopped)
signal.signal(signal.SIGHUP, stopped)
# Like a rendezvous: go on once every rank has started (and can be stopped), however slow the machine.
(marker.parent / f"rank{rank}.started").touch()
deadline = time.monotonic() + 60
while len(list(marker.parent.glob("rank*.started"))) < int(world) and time.monotonic() < deadline:
    time.sleep(0.05)
# One write per line: the processes of a torchrun share the pipe, and print() may write a line in two parts.
os.write(1, f"rank {rank} of {world} in {os.getcwd()}\\n".encode())
os.write(2, f"rank {rank} to stderr\\n".encode())
time.sleep(float(value("--sleep", "0")))
code = int(value("--exit-codes", "0"))
marker.write_text(f"exited with {code}")
sys.exit(code)
'''


@pytest.fixture
def fake_nodes(tmp_path):
    """(ssh stand-in, stand-in training script, its marker folder, the ssh log)."""
    ssh_log = tmp_path / "ssh.log"
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(f'#!/bin/bash\n# ssh HOST COMMAND, run here\nprintf "%s\\t%s\\n" "$1" "$2" >> {ssh_log}\n'
                   f'exec bash -c "$2"\n')
    ssh.chmod(0o755)
    script = tmp_path / "node_script.py"
    script.write_text(FAKE_NODE_SCRIPT)
    markers = tmp_path / "markers"
    markers.mkdir()
    return ssh, script, markers, ssh_log


def test_run_starts_every_node_and_prefixes_its_output(fake_nodes, tmp_path):
    ssh, script, markers, ssh_log = fake_nodes
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    common = ["--hosts", "alpha,b", "--workdir", workdir, "--python", sys.executable]
    result = launch_nodes(*common, "--run", "--ssh", ssh, "--", script, "--markers", markers)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        f"alpha | rank 0 of 2 in {workdir}", "alpha | rank 0 to stderr",
        f"b     | rank 1 of 2 in {workdir}", "b     | rank 1 to stderr"]
    printed = [line for line in launch_nodes(*common, "--", script, "--markers", markers).stdout.splitlines()
               if not line.startswith("#")]
    assert sorted(ssh_log.read_text().splitlines()) == [f"alpha\t{printed[0]}", f"b\t{printed[1]}"]
    assert [(markers / f"rank{rank}").read_text() for rank in (0, 1)] == ["exited with 0", "exited with 0"]


@pytest.mark.parametrize("host", ["node1;touch PWNED", "$(touch PWNED)", "`touch PWNED`", "node1;node2",
                                  "node1&&touch PWNED", "-oProxyCommand=touch PWNED", "node1|sh", "node'1"])
def test_a_host_name_that_is_not_one_is_refused_before_any_shell_sees_it(host, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"node0\n{host}\n")
    for args in (["--hosts", f"node0,{host}"], ["--hostfile", hostfile]):
        result = launch_nodes(*args, "--run", "--ssh", "false", "--", "x.py", cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.splitlines()) == 1 and "is not a host name or address" in result.stderr
    assert not (tmp_path / "PWNED").exists() and not (REPO / "PWNED").exists()


def test_paths_and_arguments_reach_the_node_as_written_through_a_real_shell(fake_nodes, tmp_path):
    ssh, script, markers, ssh_log = fake_nodes
    hostile = "$(touch PWNED) `touch PWNED`; touch PWNED 'quoted' \"double\" *"
    workdir = tmp_path / f"work {hostile}"
    workdir.mkdir()
    result = launch_nodes("--hosts", "alpha", "--workdir", workdir, "--python", sys.executable, "--run", "--ssh", ssh,
                          "--", script, "--markers", markers, "--note", hostile, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"alpha | rank 0 of 1 in {workdir}"
    command = ssh_log.read_text().split("\t", 1)[1].rstrip("\n")
    assert shlex.split(command)[-2:] == ["--note", hostile]  # one argument, exactly as given
    assert not any(path.name == "PWNED" for path in tmp_path.rglob("PWNED")) and not (REPO / "PWNED").exists()


def test_run_stops_the_other_nodes_when_one_fails(fake_nodes):
    ssh, script, markers, _ = fake_nodes
    # Nodes 0 and 2 would sleep 60 s: their markers say whether they were stopped (no clock needed, which
    # a busy machine's start-up would blur).
    result = launch_nodes("--hosts", "alpha,b,c", "--run", "--ssh", ssh, "--python", sys.executable, "--", script,
                          "--markers", markers, "--sleep", "60,0,60", "--exit-codes", "0,3,0")
    assert result.returncode == 3
    assert result.stderr.splitlines() == ["launch_nodes.py: node 1 (b) exited with status 3; stopping the other nodes"]
    assert [(markers / f"rank{rank}").read_text() for rank in range(3)] == [
        "stopped by SIGTERM", "exited with 3", "stopped by SIGTERM"]


def test_run_lets_the_others_finish_after_a_node_stops_for_a_requeue(fake_nodes):
    ssh, script, markers, _ = fake_nodes
    result = launch_nodes("--hosts", "alpha,b", "--run", "--ssh", ssh, "--python", sys.executable, "--", script,
                          "--markers", markers, "--sleep", "1.5,0", "--exit-codes", "75,75")
    assert (result.returncode, result.stderr) == (75, "")
    assert [(markers / f"rank{rank}").read_text() for rank in (0, 1)] == ["exited with 75", "exited with 75"]


def test_sigterm_to_the_launcher_stops_every_node(fake_nodes):
    ssh, script, markers, _ = fake_nodes
    launcher = subprocess.Popen([sys.executable, LAUNCH_NODES, "--hosts", "alpha,b", "--run", "--ssh", ssh,
                                 "--python", sys.executable, "--", script, "--markers", markers, "--sleep", "60,60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    greetings = [launcher.stdout.readline() for _ in range(4)]  # both nodes have started (2 lines each)
    assert sum(" of 2 in " in line for line in greetings) == 2, greetings
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert stderr.splitlines() == ["launch_nodes.py: SIGTERM: stopping every node"]
    assert [(markers / f"rank{rank}").read_text() for rank in (0, 1)] == ["stopped by SIGTERM"] * 2


@pytest.mark.slow
def test_run_in_torchrun_style_meets_as_one_job(fake_nodes):
    """Two real torchruns, node ranks 0 and 1 on this machine, 2 processes each: one job of 4."""
    ssh, script, markers, _ = fake_nodes
    result = launch_nodes("--hosts", "127.0.0.1,localhost", "--run", "--ssh", ssh, "--style", "torchrun",
                          "--python", sys.executable, "--nproc-per-node", "2", "--port", free_port(20000, 30000),
                          "--", script, "--markers", markers)
    assert result.returncode == 0, result.stdout + result.stderr
    greetings = sorted(line for line in result.stdout.splitlines() if " of 4 in " in line)
    assert greetings == [f"{host} | rank {rank} of 4 in {REPO}"
                         for host, rank in (("127.0.0.1", 0), ("127.0.0.1", 1), ("localhost", 2), ("localhost", 3))]


@pytest.mark.slow
def test_run_trains_a_two_node_job(fake_nodes, tmp_path):
    """The per-node commands, run through the ssh stand-in on 127.0.0.1 and localhost, train one job."""
    ssh, _, _, _ = fake_nodes
    data = make_image_folder(tmp_path / "data")
    result = launch_nodes("--hosts", "127.0.0.1,localhost", "--run", "--ssh", ssh, "--python", sys.executable,
                          "--nproc-per-node", "1", "--port", free_port(20000, 30000), "--",
                          "imagenet_ddp.py", *TINY_TRAINING, "--logdir", tmp_path / "runs", "--run-name", "two-nodes",
                          "--dist-timeout", "60", data,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "two-nodes"
    assert epoch_rows(run_dir) == [("0", "train", "16", "2"), ("0", "val", "9", "2")]  # 2 steps x 4 x 2 processes; 5 + 4 val images
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert (environment["launcher"], environment["world_size"]) == ("spawn", 2)
    assert any(line.startswith("127.0.0.1 | ") and "epoch 0 val" in line for line in result.stdout.splitlines())

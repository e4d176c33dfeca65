"""imagenet_ddp.py and imagenet_dp.py end to end on the CPU (gloo): DDP equals
one process with the global batch, every launcher gives the same run,
validation is exact at any world size, wrong launches fail fast with one
line, and no process outlives an interrupted or crashed job."""
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common import device_input, engine, models, pipelines, spawn
from common.arguments import usable_cores
from common.launcher import SLURM_PORT_BASE, SLURM_PORT_SPAN
from common.rundir import CHECKPOINT_NAME
from helpers import (ENV, MODEL, REPO, assert_one_line_error, finish, free_port, load_checkpoint, make_image_folder,
                     max_abs_diff, metrics, run_script, running, single_run_dir, start, weights)


def correct_count(row) -> int:
    """Top-1 hits of a metrics.csv row."""
    return round(float(row["top1"]) * int(row["images"]) / 100)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("ddp") / "data")  # 24 training images, 9 val, 3 classes


# --- DDP with 2 processes x B == one process with 2B ---

@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_with_the_global_batch(data, tmp_path):
    common = [data, *MODEL, "-j", "0", "--lr", "1", "--epochs", "1", "--steps-per-epoch", "3"]
    single = run_script([REPO / "imagenet_nd.py", *common, "-b", "8", "--logdir", tmp_path / "nd"], env_extra=ENV)
    assert single.returncode == 0, single.stderr
    ddp = run_script([REPO / "imagenet_ddp.py", *common, "-b", "4", "--nproc-per-node", "2",
                      "--logdir", tmp_path / "ddp"], env_extra=ENV)
    assert ddp.returncode == 0, ddp.stderr
    nd_run, ddp_run = single_run_dir(tmp_path / "nd"), single_run_dir(tmp_path / "ddp")

    engine.seed_everything(0)  # the scripts' initialisation, to show the 3 steps moved the weights
    initial = models.build_model("squeezenet1_1", 3, image_size=32, dropout=0.0).state_dict()
    assert max_abs_diff(weights(nd_run), initial) > 1e-2
    assert max_abs_diff(weights(ddp_run), weights(nd_run)) <= 1e-5
    for nd_row, ddp_row in zip(metrics(nd_run), metrics(ddp_run)):
        assert int(ddp_row["images"]) == int(nd_row["images"]) and ddp_row["lr"] == nd_row["lr"]
        assert float(ddp_row["loss"]) == pytest.approx(float(nd_row["loss"]), abs=1e-5)
    assert int(metrics(ddp_run)[0]["images"]) == 24 and int(metrics(ddp_run)[0]["steps"]) == 3
    config = json.loads((ddp_run / "config.json").read_text())
    assert config["environment"]["world_size"] == 2 and config["environment"]["launcher"] == "spawn"
    assert config["resolved"]["global_batch"] == 8
    assert ddp_run.name.endswith("_squeezenet1_1_cpux2_b4_cpu0_optO0")


# --- one script, five launchers, the same run ---

RUN = [*MODEL, "-b", "4", "-j", "0", "--epochs", "2"]


@pytest.fixture(scope="module")
def spawned_reference(data, tmp_path_factory):
    """Plain `python imagenet_ddp.py --nproc-per-node 2`: the run every other launcher must reproduce."""
    logdir = tmp_path_factory.mktemp("spawn")
    finish([start([sys.executable, REPO / "imagenet_ddp.py", data, *RUN, "--nproc-per-node", "2",
                   "--logdir", logdir])])
    return single_run_dir(logdir)


def test_spawned_run_trains_on_every_image_once_per_epoch(spawned_reference):
    rows = metrics(spawned_reference)
    assert [(row["epoch"], row["split"], row["images"]) for row in rows] == \
        [("0", "train", "24"), ("0", "val", "9"), ("1", "train", "24"), ("1", "val", "9")]


def torchrun(*flags):
    return [sys.executable, "-m", "torch.distributed.run", *flags]


def launched(name, data, logdir):
    """The processes of one launch style, each producing one job of 2 processes."""
    script, port = REPO / "imagenet_ddp.py", free_port()
    args = [data, *RUN, "--logdir", logdir]
    if name == "per-node":  # the original tutorial's two-node commands, both nodes on this machine
        return [start([sys.executable, script, *args, "--dist-url", f"tcp://127.0.0.1:{port}", "--world-size", "2",
                       "--rank", str(node), "--nproc-per-node", "1"]) for node in (1, 0)]
    if name == "torchrun":
        return [start(torchrun("--nproc-per-node", "2", "--master-port", str(port), script, *args))]
    if name == "torchrun-rdzv":
        return [start(torchrun("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", script, *args))]
    if name == "torch.distributed.launch":
        return [start([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
                       "--master_port", str(port), script, *args])]
    if name == "slurm":  # srun -n 2 on one node, faked: the job id is chosen so the derived port is free
        job_id = free_port(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN) - SLURM_PORT_BASE + 3 * SLURM_PORT_SPAN
        slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2"}
        return [start([sys.executable, script, *args], dict(slurm, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)))
                for task in (1, 0)]
    raise ValueError(name)


LAUNCHER_RECORDED = {"per-node": "spawn", "torchrun": "torchrun", "torchrun-rdzv": "torchrun",
                     "torch.distributed.launch": "torch.distributed.launch", "slurm": "slurm"}


@pytest.mark.parametrize("name", list(LAUNCHER_RECORDED))
def test_every_launcher_gives_the_spawned_run(name, data, tmp_path, spawned_reference):
    outputs = finish(launched(name, data, tmp_path))
    run_dir = single_run_dir(tmp_path)
    assert metrics(run_dir) == metrics(spawned_reference)
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert (environment["launcher"], environment["world_size"]) == (LAUNCHER_RECORDED[name], 2)
    assert sum(output.count("finished 2 epochs") for output in outputs) == 1  # only rank 0 prints


# --- exact validation at any world size; checkpoints move between scripts ---

@pytest.mark.slow
def test_validation_counts_every_image_once_under_1_2_and_3_processes(tmp_path):
    data = make_image_folder(tmp_path / "data", val_per_class=3)
    for extra in sorted((data / "val").rglob("*.JPEG"))[:2]:
        extra.unlink()  # 7 validation images: shards of 7, 4+3 and 3+2+2
    nd = run_script([REPO / "imagenet_nd.py", data, *MODEL, "-b", "4", "-j", "0", "--epochs", "1",
                     "--logdir", tmp_path / "runs"], env_extra=ENV)
    assert nd.returncode == 0, nd.stderr
    run_dir = single_run_dir(tmp_path / "runs")
    checkpoint = run_dir / CHECKPOINT_NAME
    lines, reports = [], []
    for processes in (1, 2, 3):
        report_dir = tmp_path / f"report-{processes}"
        evaluate = [REPO / "imagenet_ddp.py", data, *MODEL, "-b", "2", "-j", "0", "-e", "--resume", checkpoint,
                    "--report-dir", report_dir]
        if processes <= usable_cores():
            stdout = finish([start([sys.executable, *evaluate, "--nproc-per-node", processes])])[0]
        else:  # more than the cores (one per process at most, on the CPU): as many one-process "nodes"
            nodes = ["--dist-url", f"tcp://127.0.0.1:{free_port()}", "--world-size", processes, "--rank"]
            stdout = finish([start([sys.executable, *evaluate, *nodes, rank]) for rank in range(processes)])[0]
        (line,) = [line for line in stdout.splitlines() if line.startswith("validation:")]
        lines.append(line)
        reports.append(((report_dir / "val_report.csv").read_text(), np.load(report_dir / "confusion_matrix.npy")))
    counts = [re.search(r"top1 ([\d.]+)% \((\d+)/(\d+)\)", line).groups() for line in lines]
    assert counts[0][2] == "7" and counts[0] == counts[1] == counts[2]
    losses = [float(re.search(r"loss ([\d.]+)", line).group(1)) for line in lines]
    assert max(losses) - min(losses) <= 1e-4
    # imagenet_nd.py's checkpoint validates under DDP as in its own last epoch.
    assert int(counts[0][1]) == correct_count(metrics(run_dir)[-1])
    # The per-class report is identical at every world size, and is the confusion matrix counted here by
    # hand, image by image, from the checkpoint's predictions; the training run's last epoch wrote the same.
    assert reports[0][0] == reports[1][0] == reports[2][0]
    by_hand = confusion_by_hand(checkpoint, data / "val")
    assert by_hand.sum() == 7 and int(np.trace(by_hand)) == int(counts[0][1])
    for _, confusion in reports:
        assert confusion.tolist() == by_hand.tolist()
    assert np.load(run_dir / "confusion_matrix.npy").tolist() == by_hand.tolist()


def confusion_by_hand(checkpoint: Path, val_dir: Path) -> np.ndarray:
    """[true, predicted] counts of the checkpoint's model over val_dir, one image at a time."""
    state = load_checkpoint(checkpoint)
    classes = state["classes"]
    model = models.build_model("squeezenet1_1", len(classes), dropout=0.0, image_size=32)
    model.load_state_dict(state["state_dict"])
    model.eval()
    validation_images = pipelines.TensorImages(train=False, image_size=32, val_resize=32)  # the default backend's
    confusion = np.zeros((len(classes), len(classes)), dtype=np.int64)
    for path in sorted(val_dir.rglob("*.JPEG")):
        with torch.no_grad():
            image = device_input.normalize(validation_images(str(path))[0])
            predicted = model(image.unsqueeze(0)).argmax().item()
        confusion[classes.index(path.parent.name), predicted] += 1
    return confusion


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_of_two_processes_continues_in_one_with_the_same_global_batch(
        spawned_reference, data, tmp_path):
    # The spawned reference run again, now with a checkpoint every 2 steps: 3 steps per epoch of
    # 2 x 4 images, so one falls at step 2 of epoch 0, after 16 of its 24 images.
    finish([start([sys.executable, REPO / "imagenet_ddp.py", data, *RUN, "--nproc-per-node", "2",
                   "--checkpoint-every", "2steps", "--keep-checkpoints", "5", "--logdir", tmp_path])])
    run_dir = single_run_dir(tmp_path)
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-6  # checkpoints change nothing
    mid_epoch = run_dir / "checkpoint-epoch000-images00000016.pth.tar"
    assert load_checkpoint(mid_epoch)["images_done"] == 16

    one = run_script([REPO / "imagenet_nd.py", data, *RUN, "-b", "8", "--resume", mid_epoch], env_extra=ENV)
    assert one.returncode == 0, one.stderr
    assert ("the checkpoint was written by 2 replicas (global batch 8, lr 0.003125); this run has 1: global "
            "batch 8, lr 0.003125 (linear scaling); epoch 0 goes on after its first 16 images") in one.stdout
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-5
    resumed, reference = metrics(run_dir), metrics(spawned_reference)
    assert [(row["epoch"], row["split"], row["images"], row["steps"]) for row in resumed] == \
        [(row["epoch"], row["split"], row["images"], row["steps"]) for row in reference]
    for ours, theirs in zip(resumed, reference):  # epoch 0's row joins both parts
        assert float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-5)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_in_imagenet_nd(spawned_reference, data):
    result = run_script([REPO / "imagenet_nd.py", data, *RUN, "-e", "--resume", spawned_reference / CHECKPOINT_NAME],
                        env_extra=ENV)
    assert result.returncode == 0, result.stderr
    correct, images = re.search(r"validation: .* top1 [\d.]+% \((\d+)/(\d+)\)", result.stdout).groups()
    last_val = metrics(spawned_reference)[-1]
    assert (int(correct), int(images)) == (correct_count(last_val), int(last_val["images"]))


@pytest.mark.slow
def test_ddp_validates_the_batchnorm_statistics_it_saves(data, tmp_path):
    # Each process updates BatchNorm running statistics from its own share of the batch; validation must
    # use rank 0's, which the checkpoint holds, or its numbers describe no saved model.
    resnet = ["-a", "resnet18", "--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "0", "--epochs", "1"]
    ddp = run_script([REPO / "imagenet_ddp.py", data, *resnet, "--nproc-per-node", "2", "--logdir", tmp_path],
                     env_extra=ENV)
    assert ddp.returncode == 0, ddp.stderr
    run_dir = single_run_dir(tmp_path)
    nd = run_script([REPO / "imagenet_nd.py", data, *resnet, "-e", "--resume", run_dir / CHECKPOINT_NAME],
                    env_extra=ENV)
    assert nd.returncode == 0, nd.stderr
    loss = float(re.search(r"validation: loss ([\d.]+)", nd.stdout).group(1))
    assert float(metrics(run_dir)[-1]["loss"]) == pytest.approx(loss, abs=2e-4)  # printed to 4 decimals


@pytest.mark.slow  # ~30 s; test_training's resume and the mid-epoch two-process test stay in the fast suite
def test_a_two_process_resume_equals_an_uninterrupted_run(data, tmp_path):
    # Random crops, flips and dropout drawn in the training processes themselves (-j 0), differently
    # on each rank: the resumed processes must draw what the uninterrupted ones drew.
    random_run = [data, "-a", "squeezenet1_1", "--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "0",
                  "--nproc-per-node", "2", "--epochs", "2"]
    whole = run_script([REPO / "imagenet_ddp.py", *random_run, "--logdir", tmp_path / "whole"], env_extra=ENV)
    first = run_script([REPO / "imagenet_ddp.py", *random_run, "--epochs", "1", "--logdir", tmp_path / "parts"],
                       env_extra=ENV)
    assert whole.returncode == 0 and first.returncode == 0, whole.stderr + first.stderr
    parts = single_run_dir(tmp_path / "parts")
    rest = run_script([REPO / "imagenet_ddp.py", *random_run, "--resume", parts / CHECKPOINT_NAME], env_extra=ENV)
    assert rest.returncode == 0, rest.stderr
    assert max_abs_diff(weights(parts), weights(single_run_dir(tmp_path / "whole"))) <= 1e-6
    assert metrics(parts) == metrics(single_run_dir(tmp_path / "whole"))


# --- wrong launches: one line, exit 2, in bounded time ---

@pytest.mark.slow
def test_port_in_use_fails_at_once(data):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_script([REPO / "imagenet_ddp.py", data, *RUN, "--dist-url", f"tcp://127.0.0.1:{port}",
                             "--world-size", "1", "--rank", "0"])
    assert_one_line_error(result, "argument --dist-url", f"port {port}", "in use")


@pytest.mark.slow
def test_a_peer_that_never_arrives_ends_the_job_after_dist_timeout(data):
    began = time.monotonic()
    result = run_script([REPO / "imagenet_ddp.py", data, *RUN, "--dist-url", f"tcp://127.0.0.1:{free_port()}",
                         "--world-size", "2", "--rank", "0", "--dist-timeout", "3"], timeout=120)
    assert_one_line_error(result, "could not join the process group of 2 processes", "--dist-timeout 3 s", "1/2")
    assert time.monotonic() - began < 60


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragment", [
    (["--world-size", "2", "--rank", "2", "--dist-url", "tcp://127.0.0.1:29999"], "argument --rank: node rank 2"),
    (["--dist-backend", "nccl"], "argument --dist-backend: nccl needs CUDA GPUs"),
    (["--sync-bn"], "argument --sync-bn"),
    (["--dist-url", "env://"], "argument --dist-url: expected tcp://HOST:PORT"),
])
def test_wrong_flags_fail_before_any_process_waits(data, flags, fragment):
    assert_one_line_error(run_script([REPO / "imagenet_ddp.py", data, *RUN, *flags]), fragment)


@pytest.mark.slow
def test_an_error_every_process_meets_is_reported_once(data):
    # 12 training images per process cannot fill a batch of 20: both workers stop, one line is printed.
    result = run_script([REPO / "imagenet_ddp.py", data, *MODEL, "-b", "20", "-j", "0", "--nproc-per-node", "2"],
                        env_extra=ENV)
    assert_one_line_error(result, "argument -b/--batch-size: 20 per process")


def _two_nodes_errors(data, node1_data, tmp_path) -> list:
    """Node 0 on `data`, node 1 on its own copy: node 1's error lines (it exits 2, node 0 fails too)."""
    port = free_port()
    nodes = [start([sys.executable, REPO / "imagenet_ddp.py", dataset, *RUN, "--dist-url", f"tcp://127.0.0.1:{port}",
                    "--world-size", "2", "--rank", str(node), "--dist-timeout", "20", "--logdir", tmp_path / "runs"])
             for node, dataset in ((0, data), (1, node1_data))]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert nodes[1].returncode == 2 and nodes[0].returncode != 0, outputs
    return [line for line in outputs[1].splitlines() if "error:" in line]


@pytest.mark.slow
def test_an_error_on_another_node_is_reported_there(data, tmp_path):
    broken = make_image_folder(tmp_path / "broken")
    for image in (broken / "val" / "class_2").iterdir():
        image.unlink()  # node 1's copy of the dataset lost a class's validation images
    errors = _two_nodes_errors(data, broken, tmp_path)
    assert errors == [f"imagenet_ddp.py: error: rank 1: {broken / 'val' / 'class_2'}: class folder has no images "
                      f"(looked for .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp)"]


@pytest.mark.slow
def test_a_node_whose_copy_of_the_data_differs_from_rank_0s_says_so(data, tmp_path):
    """Rank 0 alone scans; the first process of every other node checks its own copy of DATA when it is
    node-local (here: not a network file system), as a copy staged on each node's disk is."""
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    extra = copy / "train" / "class_1" / "zzz.JPEG"
    shutil.copy(copy / "train" / "class_1" / "000.JPEG", extra)  # node 1's copy has one image more
    assert _two_nodes_errors(data, copy, tmp_path) == [
        f"imagenet_ddp.py: error: rank 1: DATA {copy}: this node's copy differs from rank 0's (25 train images here, "
        f"24 there; the first that differs: {extra})"]


# --- no process outlives the job ---

def process_tree(root: int):
    """Pids of every descendant of `root` (from /proc: Linux)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def start_long_job(said: str = "train epoch 0 [", processes: int = 4):
    """A spawned 2-process run with one data-loading worker each, once it has `said` its line and has
    `processes` processes below it, and those. By default once it trains: 2 workers, each with a
    data-loading process (+ multiprocessing's tracker); the first step needed both workers' batches, so
    they are all there by then. Waited for, not slept for, however slow the machine."""
    job = start([sys.executable, REPO / "imagenet_ddp.py", "--synthetic", "-a", "squeezenet1_1", "--image-size", "32",
                 "--val-resize", "32", "-b", "4", "-j", "1", "-p", "1", "--nproc-per-node", "2", "--epochs", "1",
                 "--logdir", Path(os.environ.get("TMPDIR", "/tmp")) / "imagenet-ddp-test-runs"])
    for line in job.stdout:
        if line.startswith(said):
            break
    deadline = time.monotonic() + 60
    while len(tree := process_tree(job.pid)) < processes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tree) >= processes, tree
    return job, tree


def wait_until_gone(job, tree, seconds):
    """The processes of `tree` still running after `seconds`; those are then
    killed, so that reading the job's output cannot wait for them forever."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (job.poll() is None or any(map(running, tree))):
        time.sleep(0.1)
    left = [pid for pid in tree if running(pid)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


# How long the processes of a stopped job may take to be gone: the launcher's own deadlines (common.spawn:
# the others' grace after a failure, then SIGTERM and SIGKILL after WORKER_KILL_SECONDS; data-loading
# processes die with their worker), and as much again for a busy machine's exits. A process that outlives
# its job never ends, so the margin costs nothing when the test passes and misses no failure.
GONE_AFTER_A_STOP_SECONDS = 2 * (spawn.WORKER_STOP_GRACE_SECONDS + spawn.WORKER_KILL_SECONDS) + 10


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_sigint_to_the_launcher_ends_every_process():
    job, tree = start_long_job()
    job.send_signal(signal.SIGINT)
    left = wait_until_gone(job, tree, GONE_AFTER_A_STOP_SECONDS)
    output = job.stdout.read()
    assert left == [] and job.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_sigterm_while_the_workers_start_stops_the_job_as_interrupted_not_as_failed():
    # Both workers spawned: each now imports torch (seconds, in a fresh interpreter), some way from training.
    job, tree = start_long_job(said="starting 2 worker processes", processes=2)
    job.send_signal(signal.SIGTERM)
    left = wait_until_gone(job, tree, GONE_AFTER_A_STOP_SECONDS)
    output = job.stdout.read()
    # It was a traceback from inside an import, or "worker rank0 was killed by SIGTERM", and exit status 1.
    assert left == [] and job.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output and "error" not in output, output


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_a_crashed_worker_stops_the_others():
    job, tree = start_long_job()
    workers = [pid for pid in process_tree(job.pid)
               if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()
               and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(job.pid)]
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    left = wait_until_gone(job, tree, GONE_AFTER_A_STOP_SECONDS)
    output = job.stdout.read()
    assert left == [] and job.returncode == 1, output
    assert re.search(r"error: worker rank\d was killed by SIGKILL .*; stopped the other workers", output)


def spawned_workers(launcher: int) -> list:
    """The training processes `python imagenet_ddp.py` spawned, in rank order: spawn starts rank 0 first, and
    Linux hands out pids in increasing order."""
    return sorted(pid for pid in process_tree(launcher) if parent_of(pid) == launcher
                  and "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text())


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# --dist-timeout of the run below: far above any wait of its healthy collectives on a loaded 2-core machine.
DIST_TIMEOUT = 10


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_a_stopped_worker_is_named_by_its_peer_and_by_the_launcher_which_exit_with_status_4(tmp_path):
    job = start([sys.executable, REPO / "imagenet_ddp.py", "--synthetic", *MODEL, "-b", "4", "-j", "0",
                 "--nproc-per-node", "2", "--epochs", "1", "--steps-per-epoch", "100000", "--dist-timeout",
                 DIST_TIMEOUT, "--checkpoint-every", "0", "--io-interval", "0", "--logdir", tmp_path / "runs"])
    lines = []
    for line in job.stdout:
        lines.append(line)
        if re.match(r"train epoch 0 \[ *3/", line):  # training: every collective of the start is behind
            break
    tree = process_tree(job.pid)
    rank0, rank1 = spawned_workers(job.pid)
    os.kill(rank1, signal.SIGSTOP)
    left = wait_until_gone(job, tree, DIST_TIMEOUT + GONE_AFTER_A_STOP_SECONDS)
    lines += job.stdout.readlines()
    output = "".join(lines)
    assert left == [] and job.returncode == 4 and "Traceback" not in output, output
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 2, output
    # Rank 0 heard from rank 1 last at the end of the last step it completed: the last one it printed.
    last_step = int(re.findall(r"^train epoch 0 \[ *(\d+)/100000\]", output, re.MULTILINE)[-1])
    # gloo's words depend on where the time ran out: in a collective the step waits for, or in one DDP started
    # during backward (gloo then closes the pair; seen in a clean-clone CI run on the 2-core Xeon).
    timed_out = rf"Timed out waiting {DIST_TIMEOUT * 1000}ms for \w+ operation to complete|Application timeout " \
                rf"caused pair closure"
    assert re.fullmatch(rf"imagenet_ddp\.py: error: rank 0: lost rank 1: no answer within --dist-timeout "
                        rf"{DIST_TIMEOUT} s \(({timed_out})\); last heard from it at \d\d:\d\d:\d\d \(epoch 0 step "
                        rf"{last_step}/100000 done\); it stopped or hangs: its output, or its node's, may say why\n",
                        errors[0]), output
    assert errors[1] == (f"imagenet_ddp.py: error: worker rank1 stopped answering (its state: stopped by a signal, "
                         f"SIGSTOP or SIGTSTP?): its peers gave up on it after --dist-timeout {DIST_TIMEOUT} s; "
                         f"killed it and stopped the other workers of this node\n"), output


# --- nn.DataParallel ---

def _record_how_data_loading_workers_start(cfg, ctx):
    """train() for spawn.start: the context this worker's DataLoader workers would be started with."""
    from common import process_signals

    Path(os.environ["RECORD_DIR"], f"rank{ctx.rank}").write_text(type(process_signals.data_loader_context()).__name__)


@pytest.mark.skipif(sys.platform != "linux" or sys.version_info >= (3, 14), reason="fork is not the default here")
def test_spawned_workers_fork_their_data_loading_workers(tmp_path, monkeypatch):
    """A worker that spawn.start spawns inherits "spawn" as its start method: its DataLoader
    workers would be spawned anew every epoch, each importing torch (3 short epochs of the digits
    took 48 s instead of 3.5 on 2 cores). They fork, as under torchrun."""
    from common import cli, spawn

    monkeypatch.setenv("RECORD_DIR", str(tmp_path))
    spawn.start(_record_how_data_loading_workers_start,
                 cli.parse("ddp", ["--synthetic", "--device", "cpu", "--nproc-per-node", "2"]))
    assert sorted(path.read_text() for path in tmp_path.glob("rank*")) == ["_WorkerContext"] * 2


def _record_the_lists_each_rank_finds(cfg, ctx):
    """train() for spawn.start: how many scans of DATA this process made, and the lists it got."""
    from common import dataset_lists

    scans = []
    scan = dataset_lists.scan_dataset
    dataset_lists.scan_dataset = lambda root: scans.append(root) or scan(root)
    lists = dataset_lists.find_lists(cfg.data, cfg.file_list, ctx)
    Path(os.environ["RECORD_DIR"], f"rank{ctx.rank}.json").write_text(json.dumps(
        {"scans": len(scans), "train": [list(sample) for sample in lists.train], "classes": lists.classes}))


def test_one_process_of_a_job_scans_the_data_and_the_next_job_reads_its_cache(data, tmp_path, monkeypatch):
    from common import cli, spawn

    monkeypatch.setenv("RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no scan of `data` cached by other tests
    cfg = cli.parse("ddp", [str(data), "--device", "cpu", "--nproc-per-node", "2", "--logdir", str(tmp_path / "runs")])
    found = []
    for _ in range(2):
        spawn.start(_record_the_lists_each_rank_finds, cfg)
        found.append([json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)])
    (first, second), (third, fourth) = found
    assert [first["scans"], second["scans"], third["scans"], fourth["scans"]] == [1, 0, 0, 0]  # then the cache
    assert first["train"] == second["train"] == third["train"] == fourth["train"] and len(first["train"]) > 10
    # A mistake the primary meets ends every process alike: one line, exit status 2.
    (tmp_path / "list.txt").write_text("train/nowhere/x.JPEG 0\nval/nowhere/y.JPEG 0\n")
    with pytest.raises(SystemExit) as stopped:
        spawn.start(_record_the_lists_each_rank_finds, dataclasses.replace(cfg, file_list=str(tmp_path / "list.txt")))
    assert stopped.value.code == 2


def test_data_parallel_on_the_cpu_is_one_replica_and_trains_as_imagenet_nd(data, tmp_path):
    common = [data, *MODEL, "-b", "4", "-j", "0", "--epochs", "1", "--steps-per-epoch", "2"]
    dp = run_script([REPO / "imagenet_dp.py", *common, "--logdir", tmp_path / "dp"], env_extra=ENV)
    nd = run_script([REPO / "imagenet_nd.py", *common, "--logdir", tmp_path / "nd"], env_extra=ENV)
    assert dp.returncode == 0 and nd.returncode == 0, dp.stderr + nd.stderr
    assert dp.stdout.count("no GPU in use: one replica on the CPU, without nn.DataParallel") == 1
    dp_run, nd_run = single_run_dir(tmp_path / "dp"), single_run_dir(tmp_path / "nd")
    assert max_abs_diff(weights(dp_run), weights(nd_run)) == 0.0
    assert metrics(dp_run) == metrics(nd_run)


@pytest.mark.slow
def test_data_parallel_alexnet_checkpoint_has_plain_names(data, tmp_path):
    result = run_script([REPO / "imagenet_dp.py", data, "-a", "alexnet", "--image-size", "64", "--val-resize", "64",
                         "-b", "4", "-j", "0", "--epochs", "1", "--steps-per-epoch", "1", "--logdir", tmp_path],
                        env_extra=ENV)
    assert result.returncode == 0, result.stderr
    state = weights(single_run_dir(tmp_path))
    assert "features.0.weight" in state and not any("module" in key for key in state)

"""run_scripts/ray_train.py and ray_tune.py: the entry scripts' own training
under Ray Train and Ray Tune (CPU, gloo, tiny trees). A Ray Train run equals
the spawned DDP run; a killed worker is restarted from the run's checkpoint
with the same end; a lost node leaves the run to finish on fewer workers,
each image of an epoch counted once; Tune runs one directory per trial and
ASHA stops a lagging one; wrong input is one line before anything starts.

The end-to-end tests need Ray (requirements-ray.txt; CI installs it) and are
slow (Ray's start-up is 10-20 s a run); the input checks run everywhere."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from common.errors import UsageError
from helpers import (ENV, MODEL, REPO, assert_one_line_error, free_port, make_image_folder, max_abs_diff, metrics,
                     metrics_rows, run_command, single_run_dir, slowed_steps, weights, write_slow_steps)

RAY_INSTALLED = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not RAY_INSTALLED, reason="Ray is not installed (pip install -r requirements-ray.txt)")
RAY_TRAIN = REPO / "run_scripts" / "ray_train.py"
RAY_TUNE = REPO / "run_scripts" / "ray_tune.py"
# MODEL at 64 pixels: 18 steps of 2 x 4 images per epoch.
RUN = [*MODEL, "--image-size", "64", "--val-resize", "64", "-b", "4", "-j", "0", "--epochs", "2"]
# A worker or a node is lost mid-epoch, after the line that says where training is: the 16 steps left
# of the epoch must outlast Ray's forwarding of that line and the test's reading of it. Some 40 ms each
# on 2 busy cores, they would not on a faster machine: the runs that lose one sleep this long in each
# optimizer step (helpers.slowed_steps), at least 2.4 s for those 16 whatever the machine.
STEP_DELAY = 0.15


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("ray") / "data", train_per_class=48, size=64)  # 144 images


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory) -> Path:
    return write_slow_steps(tmp_path_factory.mktemp("slow-steps"))


@pytest.fixture
def ray_env(tmp_path):
    """The clusters' token (Ray >= 2.59 asks for one) in this test's folder, not the tester's ~/.ray."""
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    return {**ENV, "RAY_AUTH_TOKEN_PATH": str(token), "RAY_ADDRESS": ""}


def ray_processes() -> set:
    """Processes of Ray (its servers, workers, actors) and training processes it started, by pid."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if command.startswith("ray::") or "/site-packages/ray/" in command:
            found.add(int(entry.name))
    return found


def assert_none_left(before: set, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while (ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = ray_processes() - before
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left if Path(f"/proc/{pid}").exists()]


def start(argv, env_extra, log: Path) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **env_extra)
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


def wait_for(log: Path, pattern: str, process: subprocess.Popen, seconds: float = 240.0) -> re.Match:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        assert process.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not seen:\n{log.read_text()}")


def kill_a_worker_other_than(rank0_pid: int) -> int:
    """SIGKILL a Ray Train worker process (not a data-loading child, not rank 0's); its pid."""
    def command(pid):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")

    def parent(pid):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    workers = [pid for pid in ray_processes() if command(pid).startswith("ray::RayTrainWorker")]
    victims = [pid for pid in workers if pid != rank0_pid and not command(parent(pid)).startswith("ray::RayTrainWorker")]
    assert victims, workers
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


# --- the same run as the spawned DDP run ---

@pytest.fixture(scope="module")
def spawned_reference(data, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("spawn")
    result = run_command([sys.executable, REPO / "imagenet_ddp.py", data, *RUN, "--nproc-per-node", "2",
                          "--logdir", logdir], env_extra=ENV)
    assert result.returncode == 0, result.stderr
    return single_run_dir(logdir)


@needs_ray
@pytest.mark.slow
def test_a_two_worker_ray_train_run_equals_the_spawned_ddp_run(data, tmp_path, ray_env, spawned_reference):
    before = ray_processes()
    # With a data-loading process per worker (the reference has none): forked from Ray's training thread.
    result = run_command([sys.executable, RAY_TRAIN, "--num-workers", "2", "--storage", tmp_path / "ray", "--",
                          "imagenet_ddp.py", data, *RUN, "-j", "1", "--logdir", tmp_path / "runs"], env_extra=ray_env)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = single_run_dir(tmp_path / "runs")
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-6
    assert metrics(run_dir) == metrics(spawned_reference)
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert (environment["launcher"], environment["world_size"]) == ("ray", 2)
    assert result.stdout.count("finished 2 epochs") == 1  # only rank 0 prints
    assert "Reporting training result" not in result.stdout + result.stderr  # Ray's own chatter stays out
    assert_none_left(before)


@needs_ray
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_ends_as_the_uninterrupted_one(data, tmp_path, ray_env,
                                                                                spawned_reference, slow_dir):
    before = ray_processes()
    slowed = {**ray_env, **slowed_steps(slow_dir, STEP_DELAY)}  # Ray passes both on (PYTHONPATH, its raylet's)
    log = tmp_path / "restarted.log"
    process = start([RAY_TRAIN, "--num-workers", "2", "--max-failures", "1", "--storage", tmp_path / "ray", "--",
                     "imagenet_ddp.py", data, *RUN, "--resume", "auto", "--checkpoint-every", "2steps",
                     "--logdir", tmp_path / "runs"], slowed, log)
    # Killed after epoch 0's checkpoint at step 2 of 18: the restarted group goes on from the newest one.
    rank0 = int(wait_for(log, r"\(RayTrainWorker pid=(\d+)\) checkpoint: epoch 0 step 2/18", process).group(1))
    kill_a_worker_other_than(rank0)
    assert process.wait(timeout=300) == 0, log.read_text()
    output = log.read_text()
    assert "Ray starts the worker group again (1 of --max-failures 1)" in output
    assert re.search(r"--resume auto: continuing \S+checkpoint-epoch000-images\d+\.pth\.tar \(epoch 0 after", output)
    assert "later metrics rows" not in output  # killed mid-epoch 0: nothing of it logged before
    run_dir = single_run_dir(tmp_path / "runs")
    assert [(row["epoch"], row["split"]) for row in metrics_rows(run_dir)] == [("0", "train"), ("0", "val"),
                                                                              ("1", "train"), ("1", "val")]
    assert max_abs_diff(weights(run_dir), weights(spawned_reference)) <= 1e-6
    assert [row["images"] for row in metrics_rows(run_dir)] == [row["images"] for row in metrics(spawned_reference)]
    assert_none_left(before)

    # Without a restart left, the run ends with the failure, naming the killed worker, and nothing stays.
    log = tmp_path / "failed.log"
    process = start([RAY_TRAIN, "--num-workers", "2", "--max-failures", "0", "--storage", tmp_path / "ray", "--",
                     "imagenet_ddp.py", data, *RUN, "--epochs", "1", "--logdir", tmp_path / "failed"], slowed, log)
    rank0 = int(wait_for(log, r"\(RayTrainWorker pid=(\d+)\) train epoch 0 \[ ?2/18\]", process).group(1))
    kill_a_worker_other_than(rank0)
    assert process.wait(timeout=300) == 1, log.read_text()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("ray_train.py: error: training failed (worker rank 1:"), last
    assert last.endswith("after --max-failures 0 restarts"), last
    assert_none_left(before)


@needs_ray
@pytest.mark.slow
def test_a_mistake_the_workers_meet_is_the_scripts_one_line_and_exit_2(tmp_path, ray_env):
    # An empty class folder: found when the data is scanned, in the workers, after Ray has started.
    data = make_image_folder(tmp_path / "data")
    (data / "train" / "class_9").mkdir()
    before = ray_processes()
    result = run_command([sys.executable, RAY_TRAIN, "--num-workers", "2", "--storage", tmp_path / "ray", "--",
                          "imagenet_ddp.py", data, *RUN, "--logdir", tmp_path / "runs"], env_extra=ray_env)
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ray_train.py: error: {data / 'train' / 'class_9'}: class folder has no images")
    assert result.stderr.count("ray_train.py: error:") == 1  # the script's own line, once
    assert_none_left(before)


@needs_ray
@pytest.mark.slow
def test_ctrl_c_to_ray_train_stops_the_run_and_every_process_it_started(data, tmp_path, ray_env):
    before = ray_processes()
    log = tmp_path / "interrupted.log"
    process = start([RAY_TRAIN, "--num-workers", "2", "--storage", tmp_path / "ray", "--", "imagenet_ddp.py", data,
                     *RUN, "--epochs", "50", "--logdir", tmp_path / "runs"], ray_env, log)
    wait_for(log, r"train epoch 0 \[ ?2/18\]", process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, log.read_text()
    assert log.read_text().strip().splitlines()[-1] == "ray_train.py: interrupted"
    assert_none_left(before)


# --- elastic: a node lost, the run finishes on fewer workers ---

@needs_ray
@pytest.mark.slow
def test_a_run_that_loses_a_node_mid_epoch_finishes_on_one_worker_counting_each_image_once(data, tmp_path,
                                                                                          ray_env, monkeypatch,
                                                                                          slow_dir):
    from ray.cluster_utils import Cluster

    for key in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):  # the cluster started in this process too
        monkeypatch.setenv(key, ray_env[key])
    slowed = slowed_steps(slow_dir, STEP_DELAY)
    for key, value in slowed.items():  # and its raylets start the training workers: from here too
        monkeypatch.setenv(key, value)
    # After the loss Ray first waits for MAX workers, 60 s by default, before it starts fewer.
    env = {**ray_env, **slowed, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
    before = ray_processes()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        worker_node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        log = tmp_path / "elastic.log"
        process = start([RAY_TRAIN, "--address", cluster.address, "--num-workers", "1-2", "--max-failures", "2",
                         "--storage", tmp_path / "ray", "--", "imagenet_ddp.py", data, *RUN, "--epochs", "3",
                         "--resume", "auto", "--checkpoint-every", "2steps", "--logdir", tmp_path / "runs"], env, log)
        wait_for(log, r"checkpoint: epoch 1 step 2/18", process)
        cluster.remove_node(worker_node)
        assert process.wait(timeout=400) == 0, log.read_text()
    finally:
        cluster.shutdown()
    output = log.read_text()
    assert "global batch 8 (4 per replica x 2)" in output and "global batch 4 (4 per replica x 1)" in output
    assert "ray_train.py: worker rank" in output and "Ray starts the worker group again (1 of --max-failures 2)" \
        in output
    # The one worker went on inside epoch 1, from a checkpoint of the two: nothing of epoch 1 was logged before.
    assert re.search(r"the checkpoint was written by 2 replicas .* epoch 1 goes on after its first \d+ images", output)
    assert "later metrics rows" not in output
    run_dir = single_run_dir(tmp_path / "runs")
    logged = [(row["epoch"], row["split"], row["images"]) for row in metrics_rows(run_dir)]
    assert logged == [(str(epoch), split, images) for epoch in range(3) for split, images in
                      (("train", "144"), ("val", "9"))]  # every image of each epoch once, however many workers
    assert_none_left(before)


# --- Tune: one run directory per trial, ASHA stops the lagging one ---

@needs_ray
@pytest.mark.slow
def test_a_tune_search_on_the_digits_demo_runs_each_trial_in_its_own_run_directory_and_names_the_best(
        tmp_path, ray_env):
    from common.tools.demo_data import write_digits

    write_digits(tmp_path / "digits", image_size=32)
    before = ray_processes()
    recipe = ["-a", "resnet18", "--image-size", "32", "--val-resize", "32", "--crop-scale", "0.5", "1", "--hflip", "0",
              "-b", "64", "-j", "0", "--epochs", "2", "--lr-schedule", "cosine"]
    # Started in tmp_path with relative paths, as a user types them (Tune moves each trial elsewhere).
    result = run_command([sys.executable, RAY_TUNE, "--search", "lr=grid:0.4,0.1", "--metric", "val_top1",
                          "--scheduler", "fifo", "--max-concurrent-trials", "1", "--storage", "ray", "--",
                          "imagenet_ddp.py", "digits", *recipe], cwd=tmp_path, env_extra=ray_env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    tables = list((tmp_path / "runs").glob("tune-*.trials.csv"))  # the default place: beside the run directories
    assert len(tables) == 1, tables
    table = pd.read_csv(tables[0])
    assert list(table["--lr"]) == [0.4, 0.1] and list(table["ended"]) == ["finished", "finished"]
    run_dirs = sorted(str(path) for path in (tmp_path / "runs").iterdir() if path.is_dir())
    assert run_dirs == sorted(table["run_dir"])
    for _, row in table.iterrows():
        logged = metrics_rows(Path(row["run_dir"]))
        assert [(line["epoch"], line["split"]) for line in logged] == [("0", "train"), ("0", "val"), ("1", "train"),
                                                                      ("1", "val")]
        assert row["best_val_top1"] == pytest.approx(max(float(line["top1"]) for line in logged
                                                         if line["split"] == "val"))
        config = json.loads((Path(row["run_dir"]) / "config.json").read_text())
        assert config["environment"]["launcher"] == "ray" and config["resolved"]["lr"] == pytest.approx(
            row["--lr"] * 64 / 256)  # the trial's --lr, scaled to its global batch
    best = table[table["best"]]
    assert len(best) == 1 and best.iloc[0]["best_val_top1"] == table["best_val_top1"].max()
    assert f"best trial {best.iloc[0]['trial']}" in result.stdout and best.iloc[0]["command"] in result.stdout
    # Typed where the search ran (tmp_path, outside the repository): the launcher's whole path.
    assert best.iloc[0]["command"].startswith(f"python {RAY_TRAIN} --num-workers 1 -- imagenet_ddp.py ")
    assert (tmp_path / "ray").is_dir()  # --storage, relative to where it was started
    assert_none_left(before)


@needs_ray
@pytest.mark.slow
def test_asha_stops_a_trial_whose_metric_lags_at_its_first_rung(data, tmp_path, ray_env):
    # Built so that ASHA must stop the second trial: trials run one at a time, in the grid's order, and
    # the metric (training images per epoch) is 24 for the first and 8 for the second, at every epoch.
    # ASHA's first rung (1 epoch) keeps the best half of what it has seen.
    before = ray_processes()
    result = run_command([sys.executable, RAY_TUNE, "--search", "steps-per-epoch=grid:6,2", "--metric",
                          "train_images", "--scheduler", "asha", "--grace-epochs", "1", "--reduction-factor", "2",
                          "--max-concurrent-trials", "1", "--storage", tmp_path / "ray", "--out",
                          tmp_path / "trials.csv", "--", "imagenet_ddp.py", data, *RUN, "--logdir",
                          tmp_path / "runs"], env_extra=ray_env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    table = pd.read_csv(tmp_path / "trials.csv")
    assert list(table["--steps-per-epoch"]) == [6, 2]
    assert list(table["ended"]) == ["finished", "stopped early"]
    assert list(table["epochs"]) == [2, 1] and list(table["last_train_images"]) == [24, 8]
    # The stopped trial's own run directory holds what it ran before Tune stopped it: its first epoch, and
    # here (epochs of a second) maybe the next one, done before the stop arrived.
    assert [len(metrics_rows(Path(run_dir))) >= 2 for run_dir in table["run_dir"]] == [True, True]
    assert list(table["best"]) == [True, False]
    assert_none_left(before)


# --- wrong input: one line, exit 2, Ray never imported ---

@pytest.fixture
def ray_stand_in(tmp_path):
    """A `ray` package that records being imported and then fails as a missing one would."""
    package = tmp_path / "stand-in" / "ray"
    package.mkdir(parents=True)
    marker = tmp_path / "ray-imported"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         f"raise ImportError('No module named ray (a stand-in)')\n")
    return {"PYTHONPATH": str(package.parent), "RAY_ADDRESS": ""}, marker


@pytest.mark.parametrize("script", [RAY_TRAIN, RAY_TUNE])
def test_without_ray_each_launcher_says_what_to_install(script, tiny_data, ray_stand_in):
    env, marker = ray_stand_in
    extra = ["--search", "lr=choice:0.1,0.2"] if script == RAY_TUNE else []
    result = run_command([sys.executable, script, *extra, "--", "imagenet_ddp.py", tiny_data], env_extra=env)
    assert_one_line_error(result, "Ray is not installed", "pip install -r requirements-ray.txt")
    assert marker.exists()


WRONG = [
    (RAY_TRAIN, ["--num-workers", "0"], "argument --num-workers: at least 1 worker"),
    (RAY_TRAIN, ["--num-workers", "3-2"], "argument --num-workers: MIN-MAX needs MIN <= MAX"),
    (RAY_TRAIN, ["--num-workers", "two"], "argument --num-workers: expected N or MIN-MAX"),
    (RAY_TRAIN, ["--max-failures", "-1"], "argument --max-failures"),
    (RAY_TUNE, ["--search", "lr=normal:0:1"], "argument --search: expected FLAG=KIND:ARGS with KIND one of"),
    (RAY_TUNE, ["--search", "lr=loguniform:0:1"], "needs LOW < HIGH and LOW > 0"),
    (RAY_TUNE, ["--search", "no-such-flag=choice:1,2"], "unrecognized arguments: --no-such-flag"),
    (RAY_TUNE, ["--search", "epochs=choice:1,x"], "argument --epochs"),
    (RAY_TUNE, ["--search", "lr=choice:0.1", "--metric", "val_accuracy"],
     "argument --metric: every run reports epoch, best_val_top1"),
    (RAY_TUNE, ["--search", "lr=choice:0.1", "--metric", "train_loss_scale"], "argument --metric"),  # fp16 only
    (RAY_TUNE, ["--search", "run-name=choice:a,b"], "--run-name is each trial's own"),
    (RAY_TUNE, ["--search", "nproc-per-node=choice:1,2"], "argument --nproc-per-node: Ray Train starts the"),
]


def launcher_main(script: Path):
    """The main() of run_scripts/ray_train.py or ray_tune.py, loaded as test_docs loads them."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: its main() runs under __main__
    return module.main


@pytest.fixture
def ray_untouched(monkeypatch):
    """Ray must not even be imported: the input is checked before anything starts."""
    from common import ray_cluster

    def import_ray():
        raise AssertionError("Ray was imported before the input was checked")

    monkeypatch.setattr(ray_cluster, "import_ray", import_ray)


@pytest.mark.parametrize("script, flags, fragment", WRONG, ids=[" ".join(flags) for _, flags, _ in WRONG])
def test_wrong_launcher_input_is_one_line_before_ray_starts(script, flags, fragment, tiny_data, ray_untouched):
    with pytest.raises(UsageError, match=re.escape(fragment)) as raised:
        launcher_main(script)([*flags, "--", "imagenet_ddp.py", str(tiny_data)])
    assert "\n" not in str(raised.value)


def test_wrong_launcher_input_from_the_command_line_is_one_line_and_exit_2(tiny_data, ray_stand_in):
    env, marker = ray_stand_in
    result = run_command([sys.executable, RAY_TUNE, "--search", "lr=normal:0:1", "--", "imagenet_ddp.py", tiny_data],
                         env_extra=env)
    assert_one_line_error(result, "argument --search: expected FLAG=KIND:ARGS")
    assert not marker.exists()  # Ray was not even imported: nothing started


@pytest.mark.parametrize("script", [RAY_TRAIN, RAY_TUNE])
def test_an_unreachable_address_is_one_line_before_ray_starts(script, tiny_data, ray_stand_in):
    env, marker = ray_stand_in
    extra = ["--search", "lr=choice:0.1,0.2"] if script == RAY_TUNE else []
    port = free_port()
    result = run_command([sys.executable, script, *extra, "--address", f"127.0.0.1:{port}", "--",
                          "imagenet_ddp.py", tiny_data], env_extra=env)
    assert_one_line_error(result, f"argument --address: cannot reach the Ray head at 127.0.0.1:{port}")
    assert not marker.exists()


@pytest.mark.parametrize("flags, command, fragment", [
    ([], ["imagenet_nd.py"], "must start with imagenet_ddp.py or imagenet_ddp_apex.py"),
    ([], ["imagenet_ddp.py", "--nproc-per-node", "2"], "argument --nproc-per-node: Ray Train starts the processes"),
    ([], ["imagenet_ddp.py", "--epochs", "0"], "argument --epochs"),
    ([], ["imagenet_ddp.py", "--device", "cuda"], "argument --device: cuda needs the launcher's --use-gpu"),
    (["--use-gpu"], ["imagenet_ddp.py", "--device", "cpu"], "argument --use-gpu: the training command says"),
    # A restarted group runs the command again: without --resume auto it would start over.
    (["--max-failures", "1"], ["imagenet_ddp.py"], "argument --max-failures: Ray restarts the training command"),
    (["--num-workers", "1-2"], ["imagenet_ddp.py"], "argument --num-workers: an elastic run restarts"),
])
def test_a_training_command_ray_cannot_run_is_one_line(flags, command, fragment, tiny_data, ray_untouched):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        launcher_main(RAY_TRAIN)([*flags, "--", *command, str(tiny_data)])


def test_an_unreachable_ray_address_variable_is_named_and_ray_client_has_its_default_port(tiny_data, ray_stand_in):
    env, marker = ray_stand_in
    result = run_command([sys.executable, RAY_TRAIN, "--", "imagenet_ddp.py", tiny_data],
                         env_extra={**env, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"})
    assert_one_line_error(result, "environment variable RAY_ADDRESS: cannot reach the Ray head at 127.0.0.1:")
    from common import ray_cluster

    with pytest.raises(UsageError, match=r"argument --address: cannot reach the Ray head at 127\.0\.0\.1:10001"):
        ray_cluster.check_address("ray://127.0.0.1")  # nothing listens on Ray Client's port here
    with pytest.raises(UsageError, match=r"argument --address: cannot reach the Ray head at ::1:"):
        ray_cluster.check_address(f"[::1]:{free_port()}")
    with pytest.raises(UsageError, match="argument --address: expected HOST:PORT"):
        ray_cluster.check_address("head-node")
    assert not marker.exists()


def test_worker_counts():
    from common.ray_cluster import worker_count

    assert (worker_count("4"), worker_count(" 2 - 8 "), worker_count("1-1")) == (4, (2, 8), (1, 1))
    for text in ("0", "0-2", "3-2", "", "2-", "-2", "x"):
        with pytest.raises(UsageError, match="argument --num-workers"):
            worker_count(text)


# --- the table of trials and the exit status of a failed run, from stand-ins for Ray's results ---

class TrialResult:
    """What trials_table reads of a Tune result."""

    def __init__(self, trial_id, config, val_top1, error=None):
        self.path, self.config, self.error = f"/storage/search/{trial_id}", config, error
        self.metrics_dataframe = pd.DataFrame({"val_top1": val_top1}) if val_top1 else None


class RunFailed(Exception):
    """Ray Train's TrainingFailedError, as far as the table reads it: the workers' exceptions by rank."""

    def __init__(self, worker_failures):
        super().__init__("Training failed due to worker errors:")
        self.worker_failures = worker_failures


def test_the_trials_table_says_how_each_trial_ended_and_never_names_a_failed_one_best(tiny_data, tmp_path):
    from common import ray_cluster

    run = ray_cluster.script_run(["imagenet_ddp.py", str(tiny_data), "--epochs", "3", "--logdir", str(tmp_path)])
    lost = RuntimeError(ray_cluster.LOST_A_PEER)
    results = [
        TrialResult("t0", {"lr": 0.1}, [20.0, 35.0, 30.0]),
        TrialResult("t1", {"lr": 0.4}, [50.0]),  # ASHA stopped it after 1 of 3 epochs
        TrialResult("t2", {"lr": 9.0}, [90.0, 95.0], RunFailed({0: lost, 1: ray_cluster.ScriptExit(
            "the training script exited with status 3")})),  # reported well, then a NaN loss
        TrialResult("t3", {"lr": 1.0}, None, RunFailed({1: ray_cluster.ScriptUsageError("argument --lr: bad")})),
    ]
    table = ray_cluster.trials_table(results, run, "search", "val_top1", "max", ["--num-workers", "2"])
    assert list(table["trial"]) == ["t0", "t1", "t2", "t3"]
    assert list(table["ended"]) == [
        "finished", "stopped early",
        "failed: training failed (worker rank 1: the training script exited with status 3; worker rank 0: "
        f"{ray_cluster.LOST_A_PEER})",
        "failed: argument --lr: bad"]
    assert list(table["exit_status"]) == [0, 0, 3, 2] and list(table["epochs"]) == [3, 1, 2, 0]
    assert list(table["best_val_top1"].fillna(-1)) == [35.0, 50.0, 95.0, -1]
    assert list(table["best"]) == [False, True, False, False]  # 95 was a trial that failed
    assert table.loc[1, "run_dir"] == str(tmp_path.resolve() / "search-t1")
    assert table.loc[1, "command"] == (f"python {ray_cluster.ray_train_path()} --num-workers 2 -- imagenet_ddp.py "
                                       f"{tiny_data} --epochs 3 --logdir {tmp_path} --lr 0.4")
    assert ray_cluster.how_it_ended(results[2].error)[0] == 3  # the script's own status, not Ray's 1
    assert ray_cluster.how_it_ended(results[3].error) == (2, "argument --lr: bad")
    wrapped = RuntimeError("ray::ImplicitFunc.train() (pid=1, ip=1.2.3.4)")  # Ray's RayTaskError of a trial
    wrapped.cause = UsageError("DATA digits: no such directory")
    assert ray_cluster.how_it_ended(wrapped) == (2, "DATA digits: no such directory")
    assert ray_cluster.how_it_ended(RunFailed({0: lost, 1: RuntimeError("A worker health check failed.")})) == (
        1, f"training failed (worker rank 1: A worker health check failed.; worker rank 0: {ray_cluster.LOST_A_PEER})")


def test_storage_is_made_absolute_where_the_launcher_runs_and_a_uri_stays_as_it_is(tmp_path, monkeypatch):
    from common.ray_cluster import storage_path

    monkeypatch.chdir(tmp_path)
    assert storage_path("ray") == str(tmp_path.resolve() / "ray")  # Ray reads it as a URI; a trial runs elsewhere
    assert storage_path("s3://bucket/runs") == "s3://bucket/runs"

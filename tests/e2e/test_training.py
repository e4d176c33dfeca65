"""imagenet_nd.py end to end on tiny data: exact step counts, the run
directory, resume == uninterrupted, evaluation, --desired-acc, no overwrites."""
import json
import os
import shutil
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import imagenet_nd
from common.rundir import BEST_NAME, CHECKPOINT_NAME
from helpers import (FAST_ARGS, REPO, load_checkpoint, make_image_folder, max_abs_diff, metrics_rows, run_script,
                     single_run_dir, weights)


def train(data, logdir, *extra):
    imagenet_nd.main([str(data), *FAST_ARGS, "--logdir", str(logdir), *extra])
    return single_run_dir(logdir)


@pytest.mark.slow
def test_synthetic_command_runs_exactly_five_steps(tmp_path):
    result = run_script([REPO / "imagenet_nd.py", "--synthetic", "-a", "resnet18", "-b", "32", "--epochs", "1",
                         "--steps-per-epoch", "5", "--image-size", "64", "--val-resize", "64",
                         "--logdir", tmp_path / "runs"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = metrics_rows(run_dir)
    assert [(row["epoch"], row["split"]) for row in rows] == [("0", "train"), ("0", "val")]
    assert int(rows[0]["steps"]) == 5 and int(rows[0]["images"]) == 5 * 32
    assert int(rows[1]["images"]) == 10 * 32  # the token validation pass of --synthetic
    assert "train epoch 0 [5/5]" in result.stdout and "[6/" not in result.stdout
    assert run_dir.name.endswith("_resnet18_cpux1_b32_cpu4_optO0")
    command = json.loads((run_dir / "config.json").read_text())["command"]
    assert "imagenet_nd.py --synthetic -a resnet18 -b 32 --epochs 1 --steps-per-epoch 5 --image-size 64" in command


@pytest.mark.slow
def test_run_directory_holds_config_metrics_tensorboard_and_checkpoints(tiny_data, tmp_path):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "2")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["options"]["arch"] == "resnet18" and config["options"]["batch_size"] == 4
    assert config["resolved"]["lr"] == pytest.approx(0.1 * 4 / 256)
    assert config["resolved"]["train_images"] == 24 and config["resolved"]["val_images"] == 9
    assert config["resolved"]["steps_per_epoch"] == 6
    assert config["environment"]["torch"] == torch.__version__ and config["environment"]["world_size"] == 1

    rows = metrics_rows(run_dir)
    assert [(row["epoch"], row["split"]) for row in rows] == [("0", "train"), ("0", "val"), ("1", "train"), ("1", "val")]
    assert [int(row["images"]) for row in rows] == [24, 9, 24, 9]
    for row in rows:
        assert 0.0 <= float(row["top1"]) <= float(row["top5"]) <= 100.0
        assert float(row["images_per_second"]) > 0

    events = EventAccumulator(str(run_dir))
    events.Reload()
    expected_tags = {"Loss/train", "Top1/train", "Top5/train", "Loss/val", "Top1/val", "Top5/val",
                     "Throughput/train", "Throughput/val", "Time/train", "Lr"}
    assert expected_tags <= set(events.Tags()["scalars"])
    top1_val = events.Scalars("Top1/val")
    assert [event.step for event in top1_val] == [1, 2]  # epochs completed, as in the upstream logs
    assert top1_val[-1].value == pytest.approx(float(rows[3]["top1"]))

    state = load_checkpoint(run_dir / CHECKPOINT_NAME)
    assert state["epoch"] == 2 and state["arch"] == "resnet18"
    assert state["classes"] == ["class_0", "class_1", "class_2"]
    assert not any(key.startswith("module.") for key in state["state_dict"])
    assert (run_dir / BEST_NAME).is_file()
    assert not list(run_dir.glob(".*tmp*"))  # atomic writes leave no temporary files behind


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_resume_equals_an_uninterrupted_run(tiny_data, tmp_path, workers):
    # Crops are seeded per image and dropout per step, in the training process with -j 0 and in
    # data-loading workers with -j 2. The resumed part runs in a fresh process, as after a real interruption.
    uninterrupted = train(tiny_data, tmp_path / "full", "--epochs", "3", "-j", workers)
    first_two = train(tiny_data, tmp_path / "split", "--epochs", "2", "-j", workers)
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "--epochs", "3", "-j", workers,
                         "--resume", first_two / CHECKPOINT_NAME])
    assert result.returncode == 0, result.stderr
    assert f"resumed from {first_two / CHECKPOINT_NAME} (epoch 2, best top-1" in result.stdout

    assert max_abs_diff(weights(uninterrupted / CHECKPOINT_NAME), weights(first_two / CHECKPOINT_NAME)) <= 1e-6
    # Logs continue in the same run directory, each epoch exactly once.
    resumed_rows = metrics_rows(first_two)
    assert [(row["epoch"], row["split"]) for row in resumed_rows] == [
        (str(epoch), split) for epoch in range(3) for split in ("train", "val")]
    full_rows = metrics_rows(uninterrupted)
    for resumed, full in zip(resumed_rows, full_rows):
        assert float(resumed["loss"]) == pytest.approx(float(full["loss"]), abs=1e-6)
        assert resumed["top1"] == full["top1"]
    assert len((first_two / "resumes.jsonl").read_text().splitlines()) == 1

    other_seed = train(tiny_data, tmp_path / "other", "--epochs", "3", "-j", workers, "--seed", "1")
    assert max_abs_diff(weights(uninterrupted / CHECKPOINT_NAME), weights(other_seed / CHECKPOINT_NAME)) > 1e-3


@pytest.mark.slow
def test_resume_from_an_earlier_epoch_keeps_the_newer_files(tiny_data, tmp_path):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "2")
    earlier = run_dir / "epoch2.pth.tar"
    shutil.copy(run_dir / CHECKPOINT_NAME, earlier)
    imagenet_nd.main([str(tiny_data), *FAST_ARGS, "--epochs", "4", "--resume", str(run_dir / CHECKPOINT_NAME)])
    newer = {name: (run_dir / name).read_bytes() for name in (CHECKPOINT_NAME, BEST_NAME, "metrics.csv")}

    imagenet_nd.main([str(tiny_data), *FAST_ARGS, "--epochs", "3", "--resume", str(earlier)])
    (backup,) = run_dir.glob("before-resume-*")
    assert {name: (backup / name).read_bytes() for name in newer} == newer  # nothing lost
    assert load_checkpoint(backup / CHECKPOINT_NAME)["epoch"] == 4
    assert [row["epoch"] for row in metrics_rows(run_dir)] == ["0", "0", "1", "1", "2", "2"]
    assert load_checkpoint(run_dir / CHECKPOINT_NAME)["epoch"] == 3


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    from common import rundir
    from common.cli import parse
    from common.distributed import single_process

    monkeypatch.setattr(rundir, "default_run_name", lambda *args: "same-second")
    cfg = parse("nd", ["--synthetic", "--logdir", str(tmp_path)])
    first, second = (rundir._choose_directory(cfg, single_process("cpu")) for _ in range(2))
    assert first == (tmp_path / "same-second", False) and second == (tmp_path / "same-second-2", False)


def test_evaluate_reproduces_the_logged_validation(tiny_data, tmp_path, capsys):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "2")
    last_val = metrics_rows(run_dir)[-1]
    capsys.readouterr()
    imagenet_nd.main([str(tiny_data), *FAST_ARGS, "--evaluate", "--resume", str(run_dir / CHECKPOINT_NAME)])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("validation:")]
    assert f"loss {float(last_val['loss']):.4f}" in line
    assert f"top1 {float(last_val['top1']):.2f}%" in line and "(9 images" in line
    assert len(metrics_rows(run_dir)) == 4  # evaluation writes nothing


def test_desired_acc_stops_after_the_epoch_that_reaches_it(tiny_data, tmp_path, capsys):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "5", "--desired-acc", "0.01")
    assert [row["epoch"] for row in metrics_rows(run_dir)] == ["0", "0"]
    assert "reached --desired-acc 1%" in capsys.readouterr().out


@pytest.mark.slow
def test_existing_run_name_is_never_overwritten(tiny_data, tmp_path):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "1", "--run-name", "mine")
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "--epochs", "1", "--run-name", "mine",
                         "--logdir", tmp_path / "runs"])
    assert result.returncode == 2 and "--run-name" in result.stderr and "already exists" in result.stderr
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before


@pytest.mark.slow
def test_resume_refuses_other_classes_or_architecture(tiny_data, tmp_path):
    run_dir = train(tiny_data, tmp_path / "runs", "--epochs", "1")
    other = make_image_folder(tmp_path / "other", classes=4, train_per_class=4, val_per_class=1)
    for evaluate in ([], ["--evaluate"]):
        result = run_script(["imagenet_nd.py", other, *FAST_ARGS, "--resume", run_dir / CHECKPOINT_NAME, *evaluate])
        assert result.returncode == 2
        assert "trained on 3 classes, DATA has 4 (only in DATA: class_3)" in result.stderr
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "-a", "resnet34", "--resume", run_dir / CHECKPOINT_NAME])
    assert result.returncode == 2 and "holds a resnet18 model, not resnet34; pass -a resnet18" in result.stderr


@pytest.mark.slow
def test_a_signal_in_the_last_step_stops_before_validation_and_the_resume_loses_nothing(tiny_data, tmp_path,
                                                                                        monkeypatch):
    from common import engine

    uninterrupted = train(tiny_data, tmp_path / "full", "--epochs", "2", "--run-name", "r")
    real_train_one_epoch = engine.Trainer.train_one_epoch
    validated = []
    real_validate = engine.Trainer.validate

    def signalled_during_the_last_step(self, loaders, epoch, start=None):
        metrics = real_train_one_epoch(self, loaders, epoch, start)
        if epoch == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # as if it came while the last step ran
        return metrics

    def counting_validate(self, loaders, epoch, **kwargs):
        validated.append(epoch)
        return real_validate(self, loaders, epoch, **kwargs)

    monkeypatch.setattr(engine.Trainer, "train_one_epoch", signalled_during_the_last_step)
    monkeypatch.setattr(engine.Trainer, "validate", counting_validate)
    command = ["--epochs", "2", "--run-name", "r", "--resume", "auto", "--requeue", "never"]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.raises(SystemExit) as stopped:
            train(tiny_data, tmp_path / "split", *command)
    finally:  # a stopping process ignores further stop signals until it exits; this one goes on
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert stopped.value.code == 75 and validated == []  # validation would have delayed the checkpoint
    run_dir = tmp_path / "split" / "r"
    state = load_checkpoint(run_dir / CHECKPOINT_NAME)
    assert (state["epoch"], state["step"], state["images_done"]) == (0, 6, 24)  # 6 steps of 4: all of epoch 0
    monkeypatch.setattr(engine.Trainer, "train_one_epoch", real_train_one_epoch)
    train(tiny_data, tmp_path / "split", *command)
    assert validated == [0, 1]
    assert max_abs_diff(weights(uninterrupted / CHECKPOINT_NAME), weights(run_dir / CHECKPOINT_NAME)) <= 1e-6
    resumed, full = metrics_rows(run_dir), metrics_rows(uninterrupted)
    assert [(row["epoch"], row["split"], row["images"], row["steps"], row["lr"]) for row in resumed] == \
        [(row["epoch"], row["split"], row["images"], row["steps"], row["lr"]) for row in full]
    assert all(float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-6)
               for ours, theirs in zip(resumed, full))

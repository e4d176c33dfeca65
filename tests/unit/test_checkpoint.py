"""Checkpoints: atomic writes, safe loading, foreign formats."""
import os
from pathlib import Path

import pytest
import torch
import torchvision

from common import checkpoint, rundir
from common.cli import parse
from common.errors import UsageError
from common.distributed import single_process
from helpers import RunsCode


def test_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "evil.pth.tar"
    torch.save({"state_dict": {}, "payload": RunsCode(marker)}, path)
    with pytest.raises(UsageError, match=r"holds code \(posix.mknod, which loading it would call\); refused"):
        checkpoint.load(str(path))
    assert not os.path.exists(marker)


def test_save_is_atomic_and_keeps_the_best(tmp_path):
    checkpoint.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, tmp_path, is_best=True)
    checkpoint.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, tmp_path, is_best=False)
    assert checkpoint.load(str(tmp_path / rundir.CHECKPOINT_NAME))["epoch"] == 2
    assert checkpoint.load(str(tmp_path / rundir.BEST_NAME))["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-epoch001-images00000000.pth.tar", "checkpoint-epoch002-images00000000.pth.tar",
        rundir.CHECKPOINT_NAME, rundir.BEST_NAME]
    # The newest is the same file as checkpoint.pth.tar, not a second copy.
    assert os.path.samefile(tmp_path / rundir.CHECKPOINT_NAME,
                            tmp_path / "checkpoint-epoch002-images00000000.pth.tar")


def test_rotation_keeps_the_newest_k_by_position_and_the_best(tmp_path):
    # Positions in images: after (1, 512) the run resumed with a global batch twice as large, so its
    # steps are numbered anew (step 3 of epoch 1 is image 768), but the order of the files holds.
    positions = [(0, 256, 2), (0, 512, 4), (1, 0, 0), (1, 512, 4), (1, 768, 3), (2, 0, 0)]
    for epoch, images, step in positions:
        path = checkpoint.save({"state_dict": {}, "epoch": epoch, "step": step, "images_done": images}, tmp_path,
                               is_best=(epoch, images) == (1, 0), keep=2)
        assert path.is_file()  # the file just written is never the one rotated out
    assert [path.name for path in rundir.kept_checkpoints(tmp_path)] == [
        "checkpoint-epoch002-images00000000.pth.tar", "checkpoint-epoch001-images00000768.pth.tar"]
    assert checkpoint.load(str(tmp_path / rundir.BEST_NAME))["epoch"] == 1  # its own file outlives rotation
    assert rundir.position_of(tmp_path / "checkpoint-epoch001-images00000768.pth.tar") == (1, 768)
    assert rundir.position_of(tmp_path / rundir.CHECKPOINT_NAME) is None


def _truncate(path):
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def test_newest_readable_falls_back_past_a_truncated_newest_with_a_warning(tmp_path):
    for images in (8, 16, 24):
        checkpoint.save({"state_dict": {"w": torch.full((3,), float(images))}, "epoch": 0, "images_done": images},
                        tmp_path, is_best=False)
    _truncate(tmp_path / rundir.CHECKPOINT_NAME)  # the same file as the newest kept one
    path, warnings = checkpoint.newest_readable(tmp_path)
    assert path == tmp_path / "checkpoint-epoch000-images00000016.pth.tar"
    assert len(warnings) == 1 and warnings[0].startswith(
        f"{tmp_path / 'checkpoint-epoch000-images00000024.pth.tar'} ({tmp_path / rundir.CHECKPOINT_NAME}) "
        f"is not a readable checkpoint (")
    for kept in rundir.kept_checkpoints(tmp_path):
        _truncate(kept)
    path, warnings = checkpoint.newest_readable(tmp_path)
    assert path is None and len(warnings) == 3  # each file read once
    (tmp_path / "empty").mkdir()
    assert checkpoint.newest_readable(tmp_path / "empty") == (None, [])


def test_a_checkpoint_pth_tar_of_its_own_is_the_last_resort(tmp_path):
    # A run directory of an older version: checkpoint.pth.tar only, no kept files.
    torch.save({"state_dict": {}, "epoch": 3}, tmp_path / rundir.CHECKPOINT_NAME)
    assert checkpoint.newest_readable(tmp_path) == (tmp_path / rundir.CHECKPOINT_NAME, [])


@pytest.mark.parametrize("run_name, environ, expected", [
    ("mine", {"SLURM_JOB_ID": "5"}, "mine"),
    (None, {"SLURM_JOB_ID": "5"}, "slurm-5"),
    (None, {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3"}, "slurm-5_3"),
    (None, {"TORCHELASTIC_RUN_ID": "abc"}, "torchrun-abc"),
])
def test_auto_run_name_stays_the_same_across_restarts(run_name, environ, expected):
    cfg = parse("nd", ["--synthetic", "--resume", "auto"] + (["--run-name", run_name] if run_name else []))
    assert rundir.auto_run_name(cfg, environ) == expected


def test_auto_without_a_stable_name_asks_for_run_name():
    cfg = parse("nd", ["--synthetic", "--resume", "auto"])
    with pytest.raises(UsageError, match="auto needs a run directory .* pass --run-name NAME"):
        rundir.auto_run_name(cfg, {"TORCHELASTIC_RUN_ID": "none"})


def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path):
    checkpoint.save({"state_dict": {}, "epoch": 1}, tmp_path, is_best=False)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        checkpoint.save({"state_dict": {}, "epoch": 2, "bad": Unpicklable()}, tmp_path, is_best=False)
    assert checkpoint.load(str(tmp_path / rundir.CHECKPOINT_NAME))["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-epoch001-images00000000.pth.tar",
                                                          rundir.CHECKPOINT_NAME]


def test_a_save_flushes_the_renames_to_disk_after_making_them(tmp_path, monkeypatch):
    """Issue 21: the file's fsync does not cover its new name; the directory's does."""
    events = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(descriptor):
        target = os.readlink(f"/proc/self/fd/{descriptor}")
        events.append(("fsync", "dir" if os.path.isdir(target) else "file"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda *args: events.append(("rename",)) or real_replace(*args))
    monkeypatch.setattr(os, "link", lambda *args: events.append(("link",)) or real_link(*args))
    checkpoint.save({"state_dict": {}, "epoch": 1}, tmp_path, is_best=True)
    renames = [index for index, event in enumerate(events) if event == ("rename",)]
    assert renames, events
    for index in renames:  # each name made is flushed by the directory's fsync right after
        assert events[index + 1] == ("fsync", "dir"), events
    assert events[0] == ("fsync", "file")  # the data itself, before its name


def test_pytorch_examples_style_checkpoint_loads(tmp_path):
    # pytorch/examples saves DataParallel weights ('module.' prefix) and best_acc1 as a tensor.
    source = torchvision.models.resnet18(num_classes=5)
    wrapped_state = {f"module.{key}": value for key, value in source.state_dict().items()}
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "examples.pth.tar"
    torch.save({"epoch": 7, "arch": "resnet18", "state_dict": wrapped_state, "best_acc1": torch.tensor(61.5),
                "optimizer": optimizer.state_dict()}, path)
    target = torchvision.models.resnet18(num_classes=5)
    point = _resume(path, target, torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9), "resnet18",
                    [f"c{i}" for i in range(5)])
    assert (point.start_epoch, point.best_acc1) == (7, 61.5)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_rng_state_round_trip():
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    state = checkpoint.capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    checkpoint.restore_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


class _NoPolicy:
    def load_state_dict(self, state):
        assert state == {}


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, message):
        self.lines.append(message)


def _resume(path, model, optimizer, arch, classes, extra=(), global_batch=256, lr=0.1, log=None):
    cfg = parse("nd", ["--synthetic", "-a", arch, "--resume", str(path), *extra])
    auto_dir = rundir.auto_run_directory(cfg) if cfg.resume == "auto" else None  # the run directory opened
    return checkpoint.resume(cfg, single_process("cpu"), model, optimizer, _NoPolicy(), classes, log or _Log(),
                             global_batch=global_batch, lr=lr, auto_dir=auto_dir)


def test_a_checkpoint_of_another_world_size_says_what_changed_and_resumes_mid_epoch(tmp_path):
    model = torch.nn.Linear(2, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.4)
    state = checkpoint.training_state(
        model=model, optimizer=sgd, precision_state={}, epoch=3, step=5, images_done=5 * 1024, partial_epoch=None,
        best_acc1=51.5, best_epoch=2, arch="resnet18", classes=["a", "b", "c"],
        config={"epochs": 90, "lr": 0.1, "lr_steps": (30, 60, 80), "data": "/elsewhere"}, world_size=8,
        global_batch=1024, lr=0.4, seed=0)
    path = checkpoint.save(state, tmp_path, is_best=False)
    log = _Log()
    point = _resume(path, torch.nn.Linear(2, 3), torch.optim.SGD(model.parameters(), lr=0.1), "resnet18",
                    ["a", "b", "c"], extra=["--epochs", "100"], global_batch=512, lr=0.2, log=log)
    assert (point.start_epoch, point.step, point.images_done, point.best_epoch) == (3, 5, 5120, 2)
    assert log.lines == [
        f"resumed from {path} (epoch 3 after 5 steps (5120 images), best top-1 51.50% at epoch 2)",
        "note: options that differ from the checkpoint's run: --epochs 100 (was 90)",
        "the checkpoint was written by 8 replicas (global batch 1024, lr 0.4); this run has 1: global batch 512, "
        "lr 0.2 (linear scaling); epoch 3 goes on after its first 5120 images"]
    with pytest.raises(UsageError, match=r"argument --seed: 7 is not the seed of .* \(0\).*pass --seed 0"):
        _resume(path, torch.nn.Linear(2, 3), torch.optim.SGD(model.parameters(), lr=0.1), "resnet18",
                ["a", "b", "c"], extra=["--seed", "7"])


def test_resume_auto_reads_the_checkpoint_it_chose_once(tmp_path, monkeypatch):
    """Issue 21: choosing the newest readable file loads it; restoring reuses that state."""
    model = torch.nn.Linear(2, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    state = checkpoint.training_state(
        model=model, optimizer=sgd, precision_state={}, epoch=2, step=0, images_done=0, partial_epoch=None,
        best_acc1=10.0, best_epoch=1, arch="resnet18", classes=["a", "b", "c"], config={}, world_size=1,
        global_batch=256, lr=0.1, seed=0)
    (tmp_path / "r").mkdir()
    saved = checkpoint.save(state, tmp_path / "r", is_best=False)
    reads = []
    real_load = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda path, *args, **kwargs: reads.append(path) or real_load(
        path, *args, **kwargs))
    point = _resume("auto", torch.nn.Linear(2, 3), torch.optim.SGD(model.parameters(), lr=0.1), "resnet18",
                    ["a", "b", "c"], extra=["--run-name", "r", "--logdir", str(tmp_path)])
    assert point.start_epoch == 2 and point.path == str(saved)
    assert len(reads) == 1, reads


def test_wrapper_names_inside_keys_are_dropped():
    # pytorch/examples wraps only AlexNet's features in DataParallel: features.module.0.weight
    state = {"features.module.0.weight": torch.ones(1), "module._orig_mod.fc.bias": torch.zeros(1)}
    assert list(checkpoint._plain_state_dict(state)) == ["features.0.weight", "fc.bias"]


def test_weights_load_into_a_model_with_a_wrapper_inside_it(tmp_path):
    """imagenet_dp.py on GPUs wraps only AlexNet's and VGG's features in
    DataParallel (as pytorch/examples does): a checkpoint's plain names load
    into features.module.*, and every tensor lands where it was saved from."""
    saved = torchvision.models.alexnet(num_classes=3)
    wrapped = torchvision.models.alexnet(num_classes=3)
    wrapped.features = torch.nn.DataParallel(wrapped.features)  # on the CPU it holds the module as on GPUs
    assert "features.module.0.weight" in wrapped.state_dict()
    state = {"arch": "alexnet", "classes": ["a", "b", "c"], "state_dict": saved.state_dict()}
    checkpoint.load_model_weights(state, wrapped, "alexnet", ["a", "b", "c"], "--resume", "x.pth.tar")
    for name, tensor in saved.state_dict().items():
        assert torch.equal(checkpoint._plain_state_dict(wrapped.state_dict())[name], tensor), name


def test_optimizer_state_that_does_not_fit_is_a_usage_error(tmp_path):
    model = torchvision.models.resnet18(num_classes=3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    adam.step()
    path = tmp_path / "adam.pth.tar"
    torch.save({"arch": "resnet18", "epoch": 1, "state_dict": model.state_dict(),
                "optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}, path)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"--resume: the optimizer state in .* does not fit"):
        _resume(path, model, sgd, "resnet18", ["a", "b", "c"])


def test_resume_auto_passes_over_a_fifo_named_like_a_checkpoint(tmp_path):
    """Issue 21: only regular files are candidates; opening a FIFO would wait for a writer forever."""
    import threading

    older = checkpoint.save({"state_dict": {}, "epoch": 1}, tmp_path, is_best=False)
    os.mkfifo(tmp_path / "checkpoint-epoch009-images00000000.pth.tar")
    found = []
    worker = threading.Thread(target=lambda: found.append(checkpoint.newest_readable(tmp_path)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "newest_readable waits on the FIFO"
    assert found == [(Path(older), [])]


class _Said:
    def __init__(self):
        self.lines, self.unwritten = [], {}

    def info(self, message):
        self.lines.append(message)

    def write_failed(self, name, why, later=None):
        self.unwritten[name] = why


def test_a_checkpoint_that_failed_to_write_is_not_taken_for_saved(tmp_path, monkeypatch):
    """After an epoch-end save that failed (a full disk; the run goes on), a stop at step 0 of the
    next epoch must write its own checkpoint, not report the older file as the stop's."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = parse("nd", ["--synthetic"])
    facts = checkpoint.RunFacts.of(cfg, global_batch=4, lr=0.1)
    saver = checkpoint.Checkpointer(model, optimizer, precision=_NoScaler(), ctx=single_process("cpu"), facts=facts,
                                    classes=["a", "b"], start=checkpoint.ResumePoint(start_epoch=0),
                                    run_dir=tmp_path)
    real_save = checkpoint.save

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", disk_full)
    with pytest.raises(OSError):
        saver.save(1, 0, 0, None, is_best=True)
    assert not saver.holds(1, 0) and saver.last_path is None
    said = _Said()
    assert saver.save_mid_epoch(1, 3, 12, {}, steps=10, stopping=False, log=said) is None  # periodic: warned
    assert said.unwritten == {"checkpoints": "No space left on device"} and "training goes on" in said.lines[0]
    monkeypatch.setattr(checkpoint, "save", real_save)
    path = saver.save_mid_epoch(1, 0, 0, {}, steps=10, stopping=True, log=said)  # the stop writes its own
    assert path == tmp_path / rundir.kept_name(1, 0) and path.is_file() and saver.holds(1, 0)


class _NoScaler:
    def state_dict(self):
        return {}


def test_a_resume_sets_aside_a_metrics_row_a_crash_cut_short(tmp_path):
    """Killed mid-append of epoch 12's row, a metrics.csv can end in '1': read as it stands, epoch 1.
    The resume keeps the whole rows, and the original file in before-resume-*/."""
    metrics = tmp_path / "metrics.csv"
    whole = b"epoch,split,top1\r\n10,train,50.0\r\n10,val,51.0\r\n11,train,52.0\r\n11,val,53.0\r\n"
    metrics.write_bytes(whole + b"1")
    said = rundir.RunDirectory(tmp_path, resuming=True).set_aside_after(12, 0, None)
    (backup,) = tmp_path.glob("before-resume-*")
    assert said == (f"before 0 later metrics rows, 1 not whole (cut short by a crash) and 0 later checkpoints of "
                    f"{tmp_path.name}: they are kept in {backup}")
    assert metrics.read_bytes() == whole and (backup / "metrics.csv").read_bytes() == whole + b"1"
    assert rundir.RunDirectory(tmp_path, resuming=True).set_aside_after(12, 0, None) is None  # nothing more to do


ZEROS = "zero bytes: space reserved but never written, as a crash or a full disk leaves it"


@pytest.mark.parametrize("content, kind", [
    (bytes(4096), f"a file of 4,096 {ZEROS}"),  # was "text": NUL is valid UTF-8
    (bytes(3 << 20), f"a file of 3,145,728 {ZEROS}"),  # read in pieces, whatever its size
    (bytes(600) + b"\x01", "not the zip archive torch.save writes"),  # zeros, then something: binary
    (b"GIF89a\x01\x00\x01\x00\x00\x00\x00", "not the zip archive torch.save writes"),  # control bytes: not text
])
def test_a_file_of_zero_bytes_or_binary_is_not_called_text(tmp_path, content, kind):
    path = tmp_path / "checkpoint.pth.tar"
    path.write_bytes(content)
    with pytest.raises(UsageError) as refused:
        checkpoint.load(str(path))
    assert str(refused.value) == f"argument --resume: {path} is not a PyTorch checkpoint ({kind})"

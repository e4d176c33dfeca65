"""A full disk during a run (issue 21, item 5): every write of the run either
survives it (one warning per file, training goes on, nothing already written
is cut short or left with half a row or record) or, for a checkpoint the run
cannot end without, stops the run with one line and exit status 74.

The disk is a real one that fills: a small tmpfs (needs root to mount; the
tests that use it skip without). A file on tmpfs fills page by page, so a
write into the last page's slack succeeds and the next fails partway: the
half row or record a full disk really leaves."""
import csv
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import torch

from common import checkpoint, cli, distributed, errors, files, fit, measure, rundir, telemetry
from common.checkpoint import ResumePoint
from common.meters import ClassReport, EpochMetrics, MetricTotals, SplitTiming
from helpers import REPO, csv_rows, make_image_folder, metrics_rows

MIB = 2 ** 20


def _mount_small_disk(mount_point: Path, size_bytes: int) -> None:
    mount_point.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({result.stderr.strip() or 'mount failed'}): needs root")


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    _mount_small_disk(mount_point, 2 * MIB)
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path) -> None:
    """Take every free byte of `disk` (a file's last page may keep some slack)."""
    with open(disk / "filler", "ab", buffering=0) as handle:
        for chunk in (b"\0" * 65536, b"\0" * 512, b"\0"):
            try:
                while True:
                    handle.write(chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC


def sizes(folder: Path) -> dict:
    """Each file's size, a TensorBoard events file's up to the end of its last whole record: what the run
    has written, which no later write may take back.

    A write that fails partway (the disk is full) leaves part of a record after that end and cuts it off
    again at once (tensorboard_events.FailSafeFile), so the file is never left shorter than before the write.
    The events are written by each writer's own thread, in this process too, so a size read here can
    fall between the two: it counts the part, and the cut looks like the file getting shorter. Seen
    once in `make test` under load (a steps/ events file); a 0.5 s sleep before the sink's cut-back
    makes it happen every time. The sink is right; reading a file mid-write was the test's race.
    A CSV file is appended by its process's main thread: here between two reads, in a whole run at
    epoch ends, not while the disk is being filled; its size is what it holds."""
    # run.lock: the run directory's lock, released (emptied) when the run ends
    return {path: _whole_records_size(path) if path.name.startswith("events.out.tfevents.") else path.stat().st_size
            for path in folder.rglob("*") if path.is_file() and path.name not in ("filler", "run.lock")}


def _whole_records_size(path: Path) -> int:
    """The bytes of an events file's whole records: each its length (8 bytes), the length's CRC (4), the
    event and its CRC (4); one write of the TensorBoard writer is one record."""
    data = path.read_bytes()
    whole = 0
    while whole + 12 <= len(data):
        end = whole + 12 + int.from_bytes(data[whole:whole + 8], "little") + 4
        if end > len(data):
            break
        whole = end
    return whole


# --- appends and rewrites: all or nothing ---

def test_an_append_cut_short_by_a_full_disk_is_undone(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    files.append_rows(path, ["epoch", "loss"], [{"epoch": 0, "loss": 2.5}])
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(descriptor, data):  # what write(2) does at the disk's last free bytes
        if len(data) > 4:
            return real_write(descriptor, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        files.append_rows(path, ["epoch", "loss"], [{"epoch": 1, "loss": 1.2345678}])
    with pytest.raises(OSError):
        files.append_rows(tmp_path / "io.csv", ["epoch", "loss"], [{"epoch": 1, "loss": 1.5}])
    monkeypatch.undo()
    assert path.read_bytes() == before  # not a byte of the half row left
    assert not (tmp_path / "io.csv").exists()  # a new file that got nothing whole is not left empty
    files.append_rows(path, ["epoch", "loss"], [{"epoch": 1, "loss": 1.5}])
    assert csv_rows(path) == [{"epoch": "0", "loss": "2.5"}, {"epoch": "1", "loss": "1.5"}]


def test_a_rewrite_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,split\n0,train\n")

    def full(self, rows):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(csv.DictWriter, "writerows", full)
    with pytest.raises(OSError):
        files.rewrite_rows(path, ["epoch", "split"], [{"epoch": 0, "split": "val"}])
    assert path.read_text() == "epoch,split\n0,train\n"
    assert sorted(item.name for item in tmp_path.iterdir()) == ["metrics.csv"]


# --- the run's logs on a disk that fills ---

def _metrics(epoch: int, split: str) -> EpochMetrics:
    totals = MetricTotals(loss_sum=2.0 * 40, top1_correct=20, top5_correct=35, count=40, timed_count=30)
    timing = SplitTiming(steps=10, warmup_steps=2, seconds=5.0, timed_seconds=4.0, data_wait_seconds=0.4,
                         all_timed_seconds=4.0, peak_memory_mib=100.0, host_memory_mib=50.0)
    return EpochMetrics.from_totals(epoch, split, totals, timing, 1, 0.1 if split == "train" else None,
                                    1000.0 + epoch, macro_f1=50.0 if split == "val" else None)


def _events_in(folder: Path) -> int:
    """Every event of the folder's event files, read through to the end: a half record would raise."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    count = 0
    for path in folder.glob("events.out.tfevents.*"):
        with open(path, "rb") as handle:
            data = handle.read()
        position = 0
        while position < len(data):  # length (8), its CRC (4), the event, its CRC (4): all there
            length = int.from_bytes(data[position:position + 8], "little")
            position += 12 + length + 4
            assert position <= len(data), f"{path} ends in part of a record"
        count += sum(1 for _ in RawEventFileLoader(str(path)).Load())
    return count


def test_the_logs_survive_a_full_disk_with_one_warning_each_and_nothing_cut_short(small_disk, capfd):
    ctx = distributed.single_process("cpu")
    log = telemetry.RunLog(ctx)
    run_dir = rundir.RunDirectory(small_disk / "run", resuming=False)
    run_dir.path.mkdir()
    cfg = cli.parse("nd", ["--synthetic", "--epochs", "90"])
    log.start_run(cfg, ResumePoint(start_epoch=0), {"steps_per_epoch": 10}, run_dir)
    report = ClassReport.from_confusion(np.array([[2, 0], [1, 1]]))
    log.io_samples([{"wall_time": 1.0, "host": "h", "device": "sda"}])
    log.epoch_end(_metrics(0, "train"), _metrics(0, "val"), report, ["cat", "dog"], 50.0, 0)
    fill(small_disk)
    before = sizes(small_disk)
    for epoch in range(1, 30):  # each file's last page fills, then a write fails partway
        log.io_samples([{"wall_time": epoch + second / 100, "host": "h", "device": "sda"} for second in range(40)])
        log.epoch_end(_metrics(epoch, "train"), _metrics(epoch, "val"), report, ["cat", "dog"], 50.0, 0)
        for step in range(10):
            log.progress_meter("train", epoch, 10).writer.add_scalar("Time/train_interval", 0.1, epoch * 10 + step)
        now = sizes(small_disk)
        assert [path for path, size in before.items() if now.get(path, 0) < size] == []
        before = now
    log.finish(fit.FitResult(epochs_run=30, seconds=60.0, best_acc1=50.0, best_epoch=0))
    out, err = capfd.readouterr()
    warnings = [line for line in out.splitlines() if line.startswith("warning: could not write")]
    for name in ("metrics.csv", "io.csv", "the TensorBoard events in", "the TensorBoard events of steps/"):
        assert sum(f"write {name}" in line for line in warnings) == 1, (name, warnings)
    assert all("No space left on device" in line for line in warnings)
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert "metrics.csv [INCOMPLETE: writes failed (No space left on device)]" in out
    # What was written is whole: every metrics row complete, every event readable to the file's end.
    rows = metrics_rows(run_dir.path)
    assert rows and all(None not in row and row["split"] in ("train", "val") for row in rows)
    assert [int(row["epoch"]) for row in rows[:2]] == [0, 0]
    assert _events_in(run_dir.path) >= 1 and _events_in(run_dir.path / "steps") >= 1
    assert not list(run_dir.path.glob(".*.tmp*"))  # no temporary file of a failed report left behind


# --- ETA: the time left, from the measured step time ---

class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _timer_after(steps_done: int, warmup: int, step_seconds: float, first_step_seconds: float = 0.0,
                 clock: FakeClock = None):
    clock = clock or FakeClock()
    timer = measure.StepTimer(30, warmup, [torch.device("cpu")], clock=clock)
    for index in range(steps_done):
        clock.now += step_seconds + (first_step_seconds if index == 0 else 0.0)
        timer.batch_ready()
        timer.step_done()
    return timer


def test_the_time_left_is_the_steps_left_at_the_mean_step_time_after_the_warm_up():
    # A first step 50 s long (warm-up) is left out: 20 steps done, 10 of them timed at 0.5 s each.
    timer = _timer_after(20, warmup=10, step_seconds=0.5, first_step_seconds=50.0)
    assert timer.mean_step_seconds() == pytest.approx(0.5)
    meter = telemetry.ProgressMeter("train", epoch=1, steps=30, world_size=1,
                                    epochs=4, validation_seconds=2.0)
    # After step 19: 10 steps left x 0.5 s = 5 s; the run: those, this epoch's validation (2 s), and
    # 2 more epochs of 30 steps x 0.5 s + 2 s each: 5 + 2 + 34 = 41 s.
    assert meter.time_left(19, timer.mean_step_seconds()) == "  ETA 0m05s (run 0m41s)"
    val = telemetry.ProgressMeter("val", epoch=1, steps=30, world_size=1,
                                  epochs=4)
    assert val.time_left(19, timer.mean_step_seconds()) == "  ETA 0m05s"  # validation: its own time left




def test_no_time_left_is_guessed_within_the_warm_up(capsys):
    clock = FakeClock()
    meter = telemetry.ProgressMeter("train", epoch=0, steps=30, world_size=1,
                                    epochs=4, clock=clock)
    timer = _timer_after(5, warmup=10, step_seconds=0.5, clock=clock)
    assert timer.mean_step_seconds() is None
    meter.show(4, MetricTotals(loss_sum=10.0, top1_correct=1, top5_correct=3, count=20), timer, 0.1)
    line = capsys.readouterr().out.strip()
    assert line.endswith("ETA --  (warm-up)") and len(line) < 150, line


def test_a_progress_line_says_the_time_left_and_stays_short(capsys):
    clock = FakeClock()
    meter = telemetry.ProgressMeter("train", epoch=12, steps=5005, world_size=8,
                                    epochs=90, validation_seconds=60.0, clock=clock, first_step=1980)
    timer = _timer_after(20, warmup=10, step_seconds=1.5, clock=clock)
    meter.show(1999, MetricTotals(loss_sum=4000.0, top1_correct=500, top5_correct=900, count=2000), timer, 0.1)
    line = capsys.readouterr().out.strip()
    # 3005 steps x 1.5 s = 4507.5 s; the run: + 60 s + 77 x (5005 x 1.5 s + 60 s) = 587,265 s = 6 d 19.1 h
    assert "  ETA 1h15m (run 6d19h)" in line, line
    assert len(line) <= 160 + len("  (warm-up)"), line  # ImageNet on 8 GPUs: about as long as it gets


def test_the_epoch_summary_says_when_the_run_ends(capsys):
    import datetime

    noon = datetime.datetime(2030, 3, 5, 12, 0, 0).timestamp()
    log = telemetry.RunLog(distributed.single_process("cpu"), wall_clock=lambda: noon)
    log.epochs = 5
    report = ClassReport.from_confusion(np.array([[2, 0], [1, 1]]))
    train, val = _metrics(1, "train"), _metrics(1, "val")  # 10 steps at 4 s / 8 timed = 0.5 s; validation 5 s
    log.epoch_end(train, val, report, ["cat", "dog"], 50.0, 1)
    # 3 more epochs x (10 x 0.5 s + 5 s) = 30 s
    assert capsys.readouterr().out.splitlines()[-1].endswith("  | run ends ~ 12:00 (0m30s left)")
    log.epochs = 2000  # 1998 x 10 s = 5 h 33 min: the same day
    log.epoch_end(train, val, report, ["cat", "dog"], 50.0, 1)
    assert capsys.readouterr().out.splitlines()[-1].endswith("run ends ~ 17:33 (5h33m left)")
    log.epochs = 20000  # another day: the date too
    log.epoch_end(train, val, report, ["cat", "dog"], 50.0, 1)
    assert capsys.readouterr().out.splitlines()[-1].endswith("run ends ~ Mar 07 19:33 (2d07h left)")
    log.epochs = 2  # after the last epoch: nothing to say
    log.epoch_end(train, val, report, ["cat", "dog"], 50.0, 1)
    assert "run ends" not in capsys.readouterr().out


# --- a whole run on a disk that fills while it trains ---

@pytest.mark.slow
def test_a_run_whose_disk_fills_warns_and_stops_with_one_line_and_status_74(tmp_path):
    data = make_image_folder(tmp_path / "data")
    disk = tmp_path / "disk"
    # Room for the start-up check (3 checkpoint files of squeezenet1_1, and 64 MiB for the logs), and no more.
    _mount_small_disk(disk, 90 * MIB)
    try:
        command = [sys.executable, REPO / "imagenet_nd.py", data, "-a", "squeezenet1_1", "--image-size", "64",
                   "--val-resize", "64", "-b", "4", "-j", "0", "-p", "1", "--epochs", "4",
                   "--keep-checkpoints", "1", "--throughput-warmup-steps", "1", "--run-name", "full",
                   "--logdir", disk]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        process = subprocess.Popen(list(map(str, command)), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        run_dir, deadline = disk / "full", time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:  # the disk fills after the first epoch
            if (run_dir / "checkpoint.pth.tar").exists():
                break
            time.sleep(0.02)
        fill(disk)
        before = sizes(disk)
        out, err = process.communicate(timeout=600)
        after = sizes(disk)
        rows = metrics_rows(run_dir)
        newest_epoch = checkpoint.load(str(run_dir / "checkpoint.pth.tar"))["epoch"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert process.returncode == errors.WRITE_FAILED_EXIT_STATUS == 74, err + out[-3000:]
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert {path.name: (size, after.get(path)) for path, size in before.items() if after.get(path, 0) < size} == {}
    # The epoch ends' checkpoints warn and training goes on; the last one ends the run in one line.
    assert "warning: could not write the checkpoint at the end of epoch 1 (No space left on device)" in out
    stopping = [line for line in out.splitlines() if line.startswith("stopping:")]
    assert len(stopping) == 1 and "the end of epoch 3, the run's last (No space left on device)" in stopping[0]
    assert f"--resume {run_dir / 'checkpoint-epoch001-images00000000.pth.tar'}" in stopping[0], stopping
    assert "epoch 3 train:" in out  # every epoch trained
    assert "[INCOMPLETE: writes failed (No space left on device)]" in out
    assert rows[:2] and all(None not in row for row in rows)  # whole rows only, epoch 0's among them
    assert newest_epoch == 1  # the newest checkpoint is whole: epoch 0's


def test_after_the_first_epoch_the_warm_up_shows_the_time_left_and_the_run_counts_whole_epochs():
    """Every epoch has its warm-up steps: once an epoch has ended, its wall time per step (warm-up
    included) stands in while the next one warms up, and prices the epochs still to come."""
    meter = telemetry.ProgressMeter("train", 1, steps=10, world_size=1, epochs=3, validation_seconds=5.0,
                                    last_epoch_seconds_per_step=0.8)
    # Within the warm-up: 9 steps left at 0.8 s; the run: + 5 s of validation + 1 epoch x (10 x 0.8 s + 5 s).
    assert meter.time_left(0, None) == "  ETA 0m07s (run 0m25s)"
    # Past it: this epoch's own mean for its steps left, the last epoch's for the epochs to come.
    assert meter.time_left(4, 0.5) == "  ETA 0m02s (run 0m20s)"  # 2.5 + 5 + 13 s
    assert telemetry.ProgressMeter("val", 1, steps=10, world_size=1,
                                   last_epoch_seconds_per_step=0.8).time_left(0, None) == "  ETA --"

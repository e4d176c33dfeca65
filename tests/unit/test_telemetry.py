"""Instrumentation: throughput and data-wait measured against a known truth,
warm-up exclusion, exact dataset bytes over two processes, block-device
sampling (exact rates from known counters; missing counters stay missing),
the per-class report against hand-computed values, and TensorBoard tags."""
import functools
import json
import os
import re
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from common import distributed, engine, files, fit, measure, precision, rundir, schedules, telemetry
from common.data import Sample
from common.meters import ClassReport, MetricSums
from helpers import REPO, csv_rows, make_image_folder, metrics_rows, run_script

# --- throughput and data wait against a known truth ---

BATCH = 8
DATA_DELAY_SECONDS = 0.05  # per batch, in the loader
COMPUTE_SECONDS = 0.10  # per step, in the model's forward


class StepClock:
    """The clock the engine times steps by, moved on only by what the model and the loader below
    take: the known truth is then exact. These tests once slept for real, and so measured the machine
    too: a 5% bound on a 150 ms step leaves 7 ms of scheduling and Python per step, which a busy 2-core
    machine overran (157.5 ms measured)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    """The engine's StepTimers read a StepClock instead of time.perf_counter."""
    clock = StepClock()
    monkeypatch.setattr(engine, "StepTimer", functools.partial(measure.StepTimer, clock=clock))
    return clock


class SlowModel(nn.Module):
    """A linear classifier whose forward takes a known time."""

    def __init__(self, clock: StepClock):
        super().__init__()
        self.clock = clock
        self.linear = nn.Linear(4, 3)

    def forward(self, images):
        self.clock.spend(COMPUTE_SECONDS)
        return self.linear(images)


class _SlowBatches:
    """Batches of common.data.Sample, each DATA_DELAY_SECONDS late."""

    dataset = None  # no image files behind them: none can be unreadable

    def __init__(self, steps: int, clock: StepClock, first_delay: float = 0.0):
        self.steps = steps
        self.clock = clock
        self.first_delay = first_delay  # extra, before the first batch (a cold start)

    def __iter__(self):
        for index in range(self.steps):
            self.clock.spend(DATA_DELAY_SECONDS + (self.first_delay if index == 0 else 0.0))
            # 100 bytes a sample: 60 from the source, 40 from a node-local cache
            yield Sample(torch.randn(BATCH, 4), torch.randint(0, 3, (BATCH,)), torch.full((BATCH,), 100),
                         torch.full((BATCH,), -1), [""] * BATCH, source_bytes=torch.full((BATCH,), 60),
                         cache_bytes=torch.full((BATCH,), 40))


class SlowLoaders:
    """What Trainer.train_one_epoch reads of common.data.Loaders, with batches
    that take a known time to arrive."""

    def __init__(self, steps: int, clock: StepClock):
        self.steps = steps
        self.clock = clock

    @property
    def train(self):
        return _SlowBatches(self.steps, self.clock)

    seed = 0
    global_batch = BATCH
    dali = None  # the batches are ready-made tensors

    def train_steps(self, limit: int = 0) -> int:
        return self.steps

    def batches(self, split: str):
        return self.train

    def set_epoch(self, epoch: int, images_done: int = 0, limit: int = 0) -> range:
        return range(self.steps)


def slow_trainer(clock: StepClock, warmup_steps: int, print_freq: int = 1000) -> engine.Trainer:
    ctx = distributed.single_process("cpu")
    model = SlowModel(clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, schedules.LRSchedule(0.1, 1), precision.FP32(),
                          ctx, telemetry.RunLog(ctx), print_freq=print_freq, warmup_steps=warmup_steps)


def test_reported_throughput_and_data_wait_match_a_known_pipeline(step_clock):
    steps, warmup = 16, 2
    trainer = slow_trainer(step_clock, warmup)
    metrics = trainer.train_one_epoch(SlowLoaders(steps, step_clock), epoch=0).metrics
    true_step_seconds = DATA_DELAY_SECONDS + COMPUTE_SECONDS
    assert metrics.warmup_steps == warmup and metrics.steps == steps and metrics.images == steps * BATCH
    assert metrics.images_per_second == pytest.approx(BATCH / true_step_seconds)
    assert metrics.images_per_second_per_gpu == metrics.images_per_second  # one replica
    assert metrics.seconds_per_step == pytest.approx(true_step_seconds)
    assert metrics.data_wait_fraction == pytest.approx(DATA_DELAY_SECONDS / true_step_seconds)
    assert metrics.dataset_bytes == steps * BATCH * 100  # the loader's per-sample file_bytes, summed
    assert (metrics.source_bytes, metrics.cache_bytes) == (steps * BATCH * 60, steps * BATCH * 40)
    assert trainer.read_bytes == {"train": (steps * BATCH * 60, steps * BATCH * 40)}  # this process's, for io.csv
    assert metrics.peak_memory_mib > 0


def test_warm_up_steps_are_left_out_of_the_rates_and_said_so(step_clock, capsys):
    """A first step 20x slower than the rest (a cold start) does not show in
    the epoch's rate, and the progress line of that interval says warm-up."""
    cold_start = 20 * (DATA_DELAY_SECONDS + COMPUTE_SECONDS)

    class ColdStartLoaders(SlowLoaders):
        @property
        def train(self):
            return _SlowBatches(self.steps, self.clock, first_delay=cold_start)

    trainer = slow_trainer(step_clock, warmup_steps=2, print_freq=2)
    metrics = trainer.train_one_epoch(ColdStartLoaders(10, step_clock), epoch=0).metrics
    assert metrics.images_per_second == pytest.approx(BATCH / (DATA_DELAY_SECONDS + COMPUTE_SECONDS))
    # The wall time keeps every step: 10 of them and the cold start.
    assert metrics.seconds == pytest.approx(10 * (DATA_DELAY_SECONDS + COMPUTE_SECONDS) + cold_start)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train")]
    assert len(lines) == 5 and lines[0].endswith("(warm-up)")
    assert not any(line.endswith("(warm-up)") for line in lines[1:])


@pytest.mark.parametrize("steps, asked, excluded", [(21, 10, 10), (20, 10, 0), (5, 0, 0), (3, 1, 1)])
def test_a_split_of_at_most_twice_the_warm_up_is_timed_whole(steps, asked, excluded):
    assert measure.StepTimer(steps, asked, [torch.device("cpu")]).warmup_steps == excluded


# --- the bytes the input pipeline read, exactly, summed over processes ---

def test_a_part_that_ends_within_its_warm_up_leaves_out_only_the_steps_it_ran():
    # A mid-epoch checkpoint after 3 steps of a 30-step split with a 10-step warm-up: joined with the
    # part after the resume (its own 10 warm-up steps of 27), 13 steps are untimed, not 20.
    ctx = distributed.single_process("cpu")
    first = measure.StepTimer(30, 10, [torch.device("cpu")])
    for _ in range(3):
        first.batch_ready()
        first.step_done()
    part = first.finish(ctx)
    assert (part.steps, part.warmup_steps, part.timed_seconds) == (3, 3, 0.0)
    rest = measure.StepTimer(27, 10, [torch.device("cpu")])
    for _ in range(27):
        rest.batch_ready()
        rest.step_done()
    joined = rest.finish(ctx, part)
    assert (joined.steps, joined.warmup_steps) == (30, 13)


@pytest.mark.slow
def test_dataset_bytes_are_the_file_sizes_summed_over_two_processes(tmp_path):
    data = make_image_folder(tmp_path / "data")  # 24 training images (3 steps of 4 per process), 9 val
    result = run_script([REPO / "imagenet_ddp.py", data, "-a", "resnet18", "--image-size", "32", "--val-resize",
                         "32", "-b", "4", "-j", "1", "--epochs", "1", "--nproc-per-node", "2", "--io-interval",
                         "0.5", "--throughput-warmup-steps", "1", "-p", "1", "--logdir", tmp_path / "runs"],
                        env_extra={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = {row["split"]: row for row in metrics_rows(run_dir)}
    for split in ("train", "val"):
        on_disk = sum(path.stat().st_size for path in (data / split).rglob("*.JPEG"))
        assert int(rows[split]["dataset_bytes"]) == on_disk
    train = rows["train"]
    assert int(train["warmup_steps"]) == 1 and int(train["images"]) == 24
    assert float(train["images_per_second_per_gpu"]) == pytest.approx(float(train["images_per_second"]) / 2)
    assert rows["val"]["macro_f1"] and not train["macro_f1"]
    # TensorBoard has the new figures, per epoch and per print interval.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set(EventAccumulator(str(run_dir)).Reload().Tags()["scalars"])
    assert {"Throughput/train", "Throughput/train_per_gpu", "Time/train", "Data/wait_fraction", "Memory/peak_mib",
            "F1/val_macro", "IO/dataset_bytes_train"} <= tags
    per_interval = EventAccumulator(str(run_dir / "steps")).Reload()
    assert {"Throughput/train_interval", "Time/train_interval", "Data/wait_fraction_train_interval"} <= set(
        per_interval.Tags()["scalars"])
    assert [event.step for event in per_interval.Scalars("Throughput/train_interval")] == [1, 2, 3]  # -p 1
    # One I/O sampler on this node; its samples reached io.csv through the primary.
    samples = csv_rows(run_dir / "io.csv")
    assert samples and len({row["host"] for row in samples}) == 1
    assert [list(samples[0])] == [measure.IO_COLUMNS]


# --- block-device sampling ---

def diskstats_line(name, major, minor, reads, sectors_read, writes, sectors_written):
    fields = [major, minor, name, reads, 0, sectors_read, 0, writes, 0, sectors_written, 0, 0, 0, 0]
    return " ".join(map(str, fields)) + "\n"


def test_io_sampler_rates_are_exact_for_known_counters(tmp_path):
    st_dev = tmp_path.stat().st_dev  # the fake device below is the one holding the "dataset"
    major, minor = os.major(st_dev), os.minor(st_dev)
    diskstats = tmp_path / "diskstats"
    diskstats.write_text(diskstats_line("loop0", 7, 0, 5, 5, 5, 5) + diskstats_line("sdz", major, minor, 100, 800, 10, 16))
    clock = iter([1000.0, 1010.0])
    sampler = measure.IOSampler(str(tmp_path), interval_seconds=60, diskstats=str(diskstats),
                                  clock=lambda: next(clock))
    assert sampler.device == "sdz"
    # 10 s later: 50 more reads of 2048 sectors (1 MiB each), 5 more writes of 8 sectors (4 KiB each).
    diskstats.write_text(diskstats_line("sdz", major, minor, 150, 800 + 50 * 2048, 15, 16 + 5 * 8))
    sampler.sample()
    (row,) = sampler.take_rows()
    assert row["device"] == "sdz" and row["wall_time"] == 1010.0
    assert row["read_bytes_per_second"] == 50 * 2048 * 512 / 10
    assert row["write_bytes_per_second"] == 5 * 8 * 512 / 10
    assert (row["read_ops_per_second"], row["write_ops_per_second"]) == (5.0, 0.5)
    assert sampler.take_rows() == []  # taken rows are not sent twice


def test_io_sampler_reports_missing_counters_as_missing_not_zero(tmp_path):
    diskstats = tmp_path / "diskstats"
    diskstats.write_text(diskstats_line("loop0", 7, 0, 5, 5, 5, 5))  # not the data's device
    sampler = measure.IOSampler(str(tmp_path), interval_seconds=60, diskstats=str(diskstats))
    sampler.sample()
    (row,) = sampler.take_rows()
    assert sampler.device is None and row["device"].startswith("none: ") and "file system" in row["device"]
    assert not any(key.endswith("_per_second") for key in row)  # written as empty cells in io.csv


def test_the_io_sampler_stops_promptly(tmp_path):
    sampler = measure.IOSampler(str(tmp_path), interval_seconds=3600).start()
    begun = time.perf_counter()
    sampler.stop()
    # Woken at once, not at its next sample an hour on: milliseconds, but a minute is as clear a line
    # between the two and no busy machine's thread join comes near it.
    assert time.perf_counter() - begun < 60


# --- the per-class report ---

def test_class_report_matches_hand_computed_values():
    # Rows: true class, columns: predicted. Class 2 has no images; class 1 is never predicted right.
    confusion = np.array([[3, 1, 0],
                          [2, 0, 2],
                          [0, 0, 0]])
    report = ClassReport.from_confusion(confusion)
    # precision = hits / predicted: class 0: 3/5; class 1: 0/1; class 2: 0/2.
    assert report.precision == pytest.approx([60.0, 0.0, 0.0])
    # recall = hits / support: 3/4, 0/4, and 0 for the class without images.
    assert report.recall == pytest.approx([75.0, 0.0, 0.0])
    assert report.f1 == pytest.approx([2 * 0.6 * 0.75 / (0.6 + 0.75) * 100, 0.0, 0.0])
    assert list(report.support) == [4, 4, 0]
    assert report.macro_f1 == pytest.approx((2 * 0.6 * 0.75 / 1.35 * 100 + 0) / 2)  # the 2 classes with images
    assert report.micro == pytest.approx(100 * 3 / 8)


def test_class_report_file_lists_every_class_then_the_averages(tmp_path):
    report = ClassReport.from_confusion(np.array([[2, 0], [1, 1]]))
    telemetry.write_class_report(report, ["cat", "dog"], 4, tmp_path / "r.csv", tmp_path / "c.npy")
    rows = csv_rows(tmp_path / "r.csv")
    assert [row["class"] for row in rows] == ["cat", "dog", "macro avg (2 classes with images)", "micro avg"]
    assert [float(row["precision_percent"]) for row in rows[:2]] == pytest.approx([66.6667, 100.0])
    assert rows[-1]["f1_percent"] == "75.0000" and rows[-1]["support"] == "4" and rows[0]["epoch"] == "4"
    assert (np.load(tmp_path / "c.npy") == [[2, 0], [1, 1]]).all()
    assert not list(Path(tmp_path).glob(".*.tmp"))  # written whole, then renamed into place


def test_io_sampler_on_a_path_this_node_cannot_see_records_missing_samples(tmp_path):
    """--synthetic samples the log directory, which on a node without a shared file system may not
    exist: the sampler must neither raise (the other processes would wait for this one) nor invent zeros."""
    sampler = measure.IOSampler(str(tmp_path / "only-on-the-primary"), interval_seconds=60)
    sampler.sample()
    (row,) = sampler.take_rows()
    assert sampler.device is None and "cannot see" in row["device"] and "read_bytes_per_second" not in row


def test_the_io_sampler_watches_where_a_sharded_datasets_reads_go(tmp_path, monkeypatch, capsys):
    """Shards: their folder's device, the node-local cache's with --data-cache (every read after a shard's
    first), none for an object store read straight (a note instead of a 'cannot see' one)."""
    from common.config import MANIFEST_NAME
    watched = []
    monkeypatch.setattr(measure, "IOSampler", lambda path, interval: watched.append(path) or types.SimpleNamespace(
        start=lambda: types.SimpleNamespace(device="vda")))
    ctx = types.SimpleNamespace(local_rank=0)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / MANIFEST_NAME).write_text("{}")
    for data, cache in ((str(tmp_path / "tree"), None), (str(tmp_path / "shards"), None),
                        (str(tmp_path / "shards"), str(tmp_path / "cache")), ("s3://bucket/shards", str(tmp_path / "c")),
                        ("s3://bucket/shards", None)):
        cfg = types.SimpleNamespace(data=data, data_cache=cache, io_interval=10.0, synthetic=False, logdir="runs")
        started = measure.start_io_sampler(cfg, ctx)
        assert (started is None) == (cache is None and data.startswith("s3://"))
    assert watched == [str(tmp_path / "tree" / "train"), str(tmp_path / "shards"), str(tmp_path / "cache"),
                       str(tmp_path / "c")]
    assert "DATA s3://bucket/shards is an object store" in capsys.readouterr().out


def test_top1_and_the_class_report_agree_on_ties():
    """Equal logits: whatever class top-1 picks, the per-class report counts the same pick."""
    sums = MetricSums(torch.device("cpu"), num_classes=4)
    logits = torch.zeros(8, 4, dtype=torch.bfloat16)
    target = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    sums.add(torch.tensor(1.0), logits, target)
    report = sums.class_report(distributed.single_process("cpu"))
    assert report.true_positives.sum() == sums.totals().top1_correct
    assert report.micro == sums.totals().top1


def test_many_classes_keep_per_class_counts_but_no_matrix():
    classes = MetricSums.CONFUSION_MAX_CLASSES + 1
    sums = MetricSums(torch.device("cpu"), num_classes=classes)
    logits = torch.zeros(2, classes)
    logits[0, 5] = logits[1, 7] = 1.0
    sums.add(torch.tensor(1.0), logits, torch.tensor([5, 6]))
    report = sums.class_report(distributed.single_process("cpu"))
    assert sums.confusion is None and report.confusion is None
    assert (report.true_positives[5], report.predicted[7], report.support[6], report.support.sum()) == (1, 1, 1, 2)
    assert report.recall[5] == 100.0 and report.precision[7] == 0.0


def test_rows_appended_to_an_older_metrics_file_get_its_header_rewritten(tmp_path):
    """Resuming a run directory written before columns were added: every row must match the header."""
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,split,loss\n0,train,2.5\n")
    files.append_rows(path, ["epoch", "split", "loss", "macro_f1"], [{"epoch": 1, "split": "val", "loss": 1.5,
                                                                          "macro_f1": 40.0}])
    rows = csv_rows(path)
    assert rows == [{"epoch": "0", "split": "train", "loss": "2.5", "macro_f1": ""},
                    {"epoch": "1", "split": "val", "loss": "1.5", "macro_f1": "40.0"}]


@pytest.mark.parametrize("cut", ["1,val,1.", "1,val", "1"])  # in a number, after a field, in the first field
def test_a_row_appended_after_one_a_killed_process_left_unfinished_is_whole(tmp_path, cut):
    """kill -9 mid-append leaves a last line without its line break: the next append must not run into it."""
    path = tmp_path / "io.csv"
    path.write_bytes(b"epoch,split,loss\r\n0,train,2.5\r\n" + cut.encode())
    files.append_rows(path, ["epoch", "split", "loss"], [{"epoch": 2, "split": "train", "loss": 1.25}])
    assert path.read_bytes() == b"epoch,split,loss\r\n0,train,2.5\r\n2,train,1.25\r\n"
    read = files.read_whole_rows(path)
    assert (len(read.rows), read.cut_lines) == (2, [])


def test_the_closing_lines_name_only_the_files_the_run_wrote(tmp_path, capsys):
    """A run stopped before its first epoch ended has no metrics, report or checkpoint: its closing
    lines must not send the user looking for them; once they exist, they are named."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    log = telemetry.RunLog(distributed.single_process("cpu"))
    log.run_dir = run_dir
    log.finish(fit.FitResult(epochs_run=0, seconds=3.0, best_acc1=float("-inf"), best_epoch=None), stopped=True)
    closing = capsys.readouterr().out.splitlines()
    assert closing[1:] == [f"run directory: {run_dir}", f"  config:      {run_dir / 'config.json'}",
                           f"  TensorBoard: tensorboard --logdir {tmp_path}"]
    for name in ("metrics.csv", "val_report.csv", rundir.CHECKPOINT_NAME, "io.csv"):
        (run_dir / name).write_text("")
    log.finish(fit.FitResult(epochs_run=1, seconds=3.0, best_acc1=50.0, best_epoch=0))
    closing = capsys.readouterr().out.splitlines()
    assert closing[2:] == [f"  metrics:     {run_dir / 'metrics.csv'}", f"  config:      {run_dir / 'config.json'}",
                           f"  per class:   {run_dir / 'val_report.csv'}",
                           f"  checkpoints: {run_dir / rundir.CHECKPOINT_NAME} (the newest)",
                           f"  I/O:         {run_dir / 'io.csv'}", f"  TensorBoard: tensorboard --logdir {tmp_path}"]
    (run_dir / rundir.BEST_NAME).write_text("")
    (run_dir / "val_report_best.csv").write_text("")
    log.unwritten["checkpoints"] = "No space left on device"
    log.finish(fit.FitResult(epochs_run=1, seconds=3.0, best_acc1=50.0, best_epoch=0))
    closing = capsys.readouterr().out
    assert f"  per class:   {run_dir / 'val_report.csv'} (best epoch: val_report_best.csv)\n" in closing
    assert (f"  checkpoints: {run_dir / rundir.CHECKPOINT_NAME} (the newest; best: model_best.pth.tar) "
            f"[INCOMPLETE: writes failed (No space left on device)]\n") in closing


def test_unreadable_files_whose_names_are_not_utf8_are_listed_as_their_own_bytes(tmp_path, capsys):
    """os.scandir hands such names over with surrogate escapes; bad_images.csv must take them, and
    be read again for the next split's list, without a UnicodeError ending the run on rank 0."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = telemetry.RunLog(distributed.single_process("cpu"))
    log.run_dir = run_dir
    odd = os.fsdecode(b"train/n01/caf\xe9.JPEG")
    log.bad_images(0, "train", 1, {odd: "truncated"})
    log.bad_images(0, "val", 2, {odd: "truncated", "val/n01/b.JPEG": "empty file"})
    assert (run_dir / "bad_images.csv").read_bytes().splitlines()[1:] == [
        b"train/n01/caf\xe9.JPEG,train,0,truncated", b"val/n01/b.JPEG,val,0,empty file"]
    said = capsys.readouterr().out
    assert "could not write" not in said and "e.g. train/n01/caf\\xe9.JPEG (truncated)" in said


# --- --profile-steps: torch.profiler over a few training steps ---

def test_busy_time_is_the_union_of_overlapping_kernels():
    assert measure.busy_microseconds([]) == 0.0
    assert measure.busy_microseconds([(0, 10), (20, 25)]) == 15.0  # disjoint: the sum
    assert measure.busy_microseconds([(20, 25), (0, 10), (5, 12), (6, 8)]) == 17.0  # overlapping and nested
    assert measure.busy_microseconds([(0, 10), (10, 20)]) == 20.0  # touching


def test_the_loops_parts_are_host_time_per_step_whatever_device_time_the_ranges_carry():
    # On the H200 torch's own table of these ranges failed an assertion (device time, no self device time).
    part = types.SimpleNamespace
    parts = [part(key="step:data", count=4, cpu_time_total=2000.0, device_time_total=900.0, self_device_time_total=0),
             part(key="step:forward", count=4, cpu_time_total=12000.0, device_time_total=5e4, self_device_time_total=0)]
    lines = measure.parts_table(parts, steps=4, step_microseconds=10000.0).splitlines()
    assert [re.split(r"\s{2,}", line.strip()) for line in lines] == [
        ["part", "CPU ms/step", "of the step", "calls"],
        ["step:forward", "3.000", "30.0%", "4"],  # 12 ms over 4 steps of 10 ms
        ["step:data", "0.500", "5.0%", "4"]]


def test_profile_steps_write_a_trace_and_a_summary_of_the_steps_after_the_warm_up(tmp_path):
    args = ["imagenet_nd.py", "--synthetic", "-a", "resnet18", "-b", "4", "--image-size", "32", "--epochs", "2",
            "--steps-per-epoch", "6", "--throughput-warmup-steps", "2", "-p", "100", "--logdir", tmp_path,
            "--run-name", "r"]
    result = run_script([*args, "--profile-steps", "3"])
    assert result.returncode == 0, result.stderr
    (folder,) = (tmp_path / "r").glob("profile-*")  # the first epoch only, from step 2 on
    assert folder.name == "profile-epoch000-step000002"
    summary = (folder / "summary.txt").read_text()
    assert summary.startswith("3 step(s) profiled: ") and "GPU" not in summary.splitlines()[0]
    rows = [re.split(r"\s{2,}", line.strip()) for line in summary.splitlines() if line.strip().startswith("step:")]
    calls = {row[0]: int(row[-1]) for row in rows}  # the table's first and last columns: name, # of calls
    # The loop's labelled parts, once per profiled step each.
    assert calls == {name: 3 for name in ("step:stop control", "step:data", "step:seed, lr, guard", "step:forward",
                                          "step:backward and optimizer", "step:metric sums")}
    trace = json.loads((folder / "trace.json").read_text())
    assert sum(event.get("name", "").startswith("ProfilerStep") and event.get("cat") == "user_annotation"
               for event in trace["traceEvents"]) == 3
    assert "profile: 3 step(s) profiled: " in result.stdout and str(folder / "summary.txt") in result.stdout
    assert "ERROR" not in result.stderr  # Kineto's complaint about the GPU a CUDA build finds missing

    zero_warmup = run_script([*args, "--profile-steps", "2", "--throughput-warmup-steps", "0", "--run-name", "zero"])
    assert zero_warmup.returncode == 0, zero_warmup.stderr  # the profiler's own warm-up step is step 0
    assert [path.name for path in (tmp_path / "zero").glob("profile-*")] == ["profile-epoch000-step000001"]
    too_many = run_script([*args, "--profile-steps", "5", "--run-name", "more"])  # 4 steps after the warm-up
    assert too_many.returncode == 0, too_many.stderr
    assert "profile: 4 of 5 steps (the epoch ended sooner) profiled: " in too_many.stdout
    late = run_script([*args, "--profile-steps", "1", "--throughput-warmup-steps", "6", "--run-name", "late"])
    assert late.returncode == 0, late.stderr
    assert "profile: the epoch ended before --profile-steps 1 steps after the warm-up; nothing recorded" in late.stdout
    assert not list((tmp_path / "late").glob("profile-*/summary.txt"))


def test_seed_generators_leaves_the_cpu_generator_as_torch_manual_seed_does():
    engine.seed_generators(1234, [torch.device("cpu")])
    ours = torch.get_rng_state()
    torch.manual_seed(1234)
    assert torch.equal(ours, torch.get_rng_state())
    engine.seed_generators(99, [torch.device("cpu")])
    assert not torch.equal(ours, torch.get_rng_state())


# --- a launcher's own channel for each epoch's figures (Ray Train's report) ---

def _epoch(split: str, **figures) -> "telemetry.EpochMetrics":
    base = dict(epoch=2, split=split, loss=1.5, top1=40.0, top5=90.0, images=100, steps=10, seconds=5.0,
                images_per_second=20.0, seconds_per_step=0.5, data_wait_fraction=0.1, lr=None, wall_time=0.0,
                peak_memory_mib=100.0, macro_f1=None)
    return telemetry.EpochMetrics(**{**base, **figures})


def test_every_process_hands_the_launcher_each_epochs_figures_under_the_names_tune_ranks_by(tmp_path):
    reported = []
    for rank in (0, 1):  # only rank 0 writes files, but Ray Train waits for every process's report
        ctx = distributed.Context(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                                  launcher_report=reported.append)
        log = telemetry.RunLog(ctx)
        log.run_dir = None
        train = _epoch("train", lr=0.1, loss_scale=None, images_per_second_per_gpu=10.0)
        val = _epoch("val", top1=55.0, macro_f1=50.0)
        report = ClassReport(np.array([1, 1]), np.array([2, 2]), np.array([2, 2]))
        log.epoch_end(train, val, report, ["a", "b"], best_acc1=60.0, best_epoch=1)
    assert len(reported) == 2 and reported[0] == reported[1]
    figures = reported[0]
    assert set(figures) <= set(telemetry.REPORTED_METRICS)
    assert (figures["epoch"], figures["best_val_top1"], figures["train_images"]) == (2, 60.0, 100)
    assert (figures["val_top1"], figures["train_top1"], figures["train_lr"], figures["val_macro_f1"]) == \
        (55.0, 40.0, 0.1, 50.0)
    assert "train_loss_scale" not in figures and "val_lr" not in telemetry.REPORTED_METRICS  # none, not None


def test_config_json_records_the_command_without_a_credential_in_it(tmp_path, monkeypatch):
    import sys

    from common.checkpoint import ResumePoint
    from common.cli import parse

    # What the command line does not refuse (a name, a value it does not read as a URL) is still shown as stars.
    monkeypatch.setattr(sys, "argv", ["imagenet_nd.py", "--synthetic", "--run-name", "https://alice:s3cret@host"])
    log = telemetry.RunLog(distributed.single_process("cpu"))
    log.start_run(parse("nd", ["--synthetic"]), ResumePoint(0), {}, types.SimpleNamespace(path=tmp_path,
                                                                                         resuming=False))
    for writer in (log._writer, log._step_writer):  # TensorBoard's, opened beside config.json
        writer.close()
    command = json.loads((tmp_path / "config.json").read_text())["command"]
    assert command.endswith("imagenet_nd.py --synthetic --run-name https://***@host") and "s3cret" not in command


def test_io_csv_says_where_each_nodes_bytes_came_from_once_a_cache_or_object_store_is_in_use(tmp_path, capsys):
    """Per epoch, split and node, the bytes pulled from DATA's storage and read from the node-local cache:
    io.csv's "data" rows, and the epoch line's split of its bytes; a folder-tree run's stay as they were."""
    ctx = distributed.single_process("cpu")
    rows = measure.gather_io_rows(None, ctx, epoch=3, read_bytes={"train": (7_000, 500), "val": (0, 90)})
    host = rows[0]["host"]
    assert rows == [{"kind": "data", "host": host, "device": "", "epoch": 3, "split": "train", "source_bytes": 7_000,
                     "cache_bytes": 500},
                    {"kind": "data", "host": host, "device": "", "epoch": 3, "split": "val", "source_bytes": 0,
                     "cache_bytes": 90}]
    # Two processes of one node and one of another: summed per node, in the order met.
    assert measure.data_rows(0, [("a", {"train": (1, 2)}), ("b", {"train": (10, 0)}), ("a", {"train": (3, 4)})]) == [
        {"kind": "data", "host": "a", "device": "", "epoch": 0, "split": "train", "source_bytes": 4, "cache_bytes": 6},
        {"kind": "data", "host": "b", "device": "", "epoch": 0, "split": "train", "source_bytes": 10,
         "cache_bytes": 0}]
    log = telemetry.RunLog(ctx)
    log.run_dir = tmp_path
    folder_tree = measure.gather_io_rows(None, ctx, epoch=0, read_bytes={"train": (2048, 0)})
    log.io_samples(folder_tree)  # nothing from a cache, no object store: no row, as before
    assert not (tmp_path / "io.csv").exists() and not log.shows_sources
    log.io_samples(rows)
    assert log.shows_sources
    assert [(row["kind"], row["epoch"], row["split"], row["source_bytes"], row["cache_bytes"], row["wall_time"])
            for row in csv_rows(tmp_path / "io.csv")] == [("data", "3", "train", "7000", "500", ""),
                                                          ("data", "3", "val", "0", "90", "")]
    train = _epoch_metrics(dataset_bytes=1_200_000, source_bytes=900_000, cache_bytes=300_000)
    assert train.bytes_read(log.shows_sources) == "1.2 MB (900.0 KB pulled from the source, 300.0 KB read from the cache)"
    assert train.bytes_read(False) == "1.2 MB"


def _epoch_metrics(**counts):
    return telemetry.EpochMetrics(epoch=0, split="train", loss=1.0, top1=1.0, top5=1.0, images=1, steps=1,
                                  seconds=1.0, images_per_second=1.0, seconds_per_step=1.0, data_wait_fraction=0.0,
                                  lr=0.1, wall_time=0.0, **counts)

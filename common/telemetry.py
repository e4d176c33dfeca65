"""Where a run's figures go: progress lines, config.json, metrics.csv,
TensorBoard scalars, the per-class report and io.csv, all inside the run
directory (common.rundir, which names and owns the files). Only the primary
process prints or writes; on the others every call is a no-op. Nothing here
is a collective: what crosses processes (metrics sums, timings, I/O samples)
is reduced by the loop first (common.engine, common.measure) and handed in.
With --tracker, the same parameters, rows and reports also go to MLflow or
W&B (common.trackers), beside the run directory; TensorBoard's writer is
common.tensorboard_events'.

What each file holds is in docs/outputs.md; TensorBoard's x-axis is epochs
completed (1-based), and steps/ holds the per-print-interval training
curves (`*_interval`, x-axis: steps).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

import torch
import torchvision

from common.checkpoint import ResumePoint
from common.config import Config
from common import hardware, provenance, recipes
from common.distributed import Context
from common.errors import UsageError, one_line, printable, without_credentials
from common.files import CSV_TEXT, append_rows, append_whole, atomic_write, atomic_write_text
from common.measure import IO_COLUMNS, StepTimer, peak_memory_mib
from common.meters import ClassReport, EpochMetrics, MetricTotals
from common.rundir import BEST_NAME, CHECKPOINT_NAME, RunDirectory
from common.storage import is_object_store
from common.tensorboard_events import EventWriter
from common.trackers import Trackers

METRICS_COLUMNS = [field.name for field in dataclasses.fields(EpochMetrics)]

# TensorBoard tag -> EpochMetrics field, per split; tags as in the upstream reference logs.
_SCALARS = {
    "train": {"Loss/train": "loss", "Top1/train": "top1", "Top5/train": "top5", "Throughput/train": "images_per_second",
              "Time/train": "seconds_per_step", "Data/wait_fraction": "data_wait_fraction", "Lr": "lr",
              "Amp/loss_scale": "loss_scale", "Amp/skipped_steps": "skipped_steps",
              "Throughput/train_per_gpu": "images_per_second_per_gpu", "Memory/peak_mib": "peak_memory_mib",
              "IO/dataset_bytes_train": "dataset_bytes", "Data/bad_images_train": "bad_images",
              "Memory/host_mib": "host_memory_mib"},
    "val": {"Loss/val": "loss", "Top1/val": "top1", "Top5/val": "top5", "Throughput/val": "images_per_second",
            "Time/val": "seconds_per_step", "F1/val_macro": "macro_f1", "Data/wait_fraction_val": "data_wait_fraction",
            "IO/dataset_bytes_val": "dataset_bytes", "Data/bad_images_val": "bad_images"},
}
# --model-ema's average, validated beside the model: tags of its own (Top1/val_ema), never the model's
_SCALARS["val_ema"] = {tag.replace("val", "val_ema"): field for tag, field in _SCALARS["val"].items()}
BAD_IMAGE_COLUMNS = ["path", "split", "first_epoch", "reason"]
# What each epoch reports to a launcher that asks (Ray Train, and through it Ray Tune's --metric): the
# epoch, the best validation top-1 so far, and each split's TensorBoard figures as <split>_<field>.
REPORTED_METRICS = ["epoch", "best_val_top1", "train_images"] + [
    f"{split}_{field}" for split, scalars in _SCALARS.items() for field in scalars.values()]
# Those every epoch of every run has (not fp16's loss scale, nor --model-ema's val_ema): what Tune may rank by.
_ALWAYS = {"loss", "top1", "top5", "images_per_second", "seconds_per_step", "data_wait_fraction"}
RANKABLE_METRICS = ["epoch", "best_val_top1", "train_images", "train_lr", "val_macro_f1"] + [
    f"{split}_{field}" for split in ("train", "val") for field in _SCALARS[split].values() if field in _ALWAYS]


def epoch_report(train: EpochMetrics, val: EpochMetrics, best_acc1: float, ema: Optional[EpochMetrics] = None) -> dict:
    """The figures of REPORTED_METRICS that this epoch has (fp16's loss scale only under fp16, val_ema's with EMA)."""
    report = {"epoch": val.epoch, "best_val_top1": best_acc1, "train_images": train.images}
    for metrics in (train, val, *((ema,) if ema is not None else ())):
        for field in _SCALARS[metrics.split].values():
            if getattr(metrics, field) is not None:
                report[f"{metrics.split}_{field}"] = getattr(metrics, field)
    return report
_NO_MORE_EVENTS = "its later events are dropped (its writer cannot go on after a failed write)"


def write_class_report(report: ClassReport, classes: List[str], epoch: int, csv_path: Path, npy_path: Path) -> None:
    """val_report.csv (a row per class, then the macro and micro averages; in
    percent) and the confusion counts as .npy, each written whole and then
    renamed into place, so a reader never sees half a file, and a write that
    fails (a full disk) leaves the previous one as it was."""
    def write_csv(handle) -> None:
        writer = csv.writer(handle)
        writer.writerow(["epoch", "class", "precision_percent", "recall_percent", "f1_percent", "support"])
        for name, precision, recall, f1, support in zip(classes, report.precision, report.recall, report.f1,
                                                          report.support):
            writer.writerow([epoch, name, f"{precision:.4f}", f"{recall:.4f}", f"{f1:.4f}", int(support)])
        present = int((report.support > 0).sum())
        writer.writerow([epoch, f"macro avg ({present} classes with images)", f"{report.macro(report.precision):.4f}",
                         f"{report.macro(report.recall):.4f}", f"{report.macro_f1:.4f}", int(report.support.sum())])
        writer.writerow([epoch, "micro avg", *(f"{report.micro:.4f}",) * 3, int(report.support.sum())])

    atomic_write_text(csv_path, write_csv)  # class names as on disk
    if report.confusion is None:  # too many classes to keep the matrix (MetricSums.CONFUSION_MAX_CLASSES)
        return
    atomic_write(npy_path, lambda handle: np.save(handle, report.confusion))


def _cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo), for results that name their hardware."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(ctx: Context) -> dict:
    """Host, versions, hardware and the code (common.provenance: it runs git,
    so this is called once per run, on the primary), for config.json,
    resumes.jsonl and RESULTS.md."""
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": ctx.device_name(),
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
        "cpu_count": os.cpu_count(),
        "world_size": ctx.world_size,  # training processes
        "replicas": ctx.replicas,  # model replicas: GPUs (or CPU processes) in the job
        "launcher": ctx.launcher,
        **hardware.describe(ctx.device),  # which half types run natively: cpu_capability, cpu_bf16_native, ...
        **provenance.code_version(),  # git_commit, git_dirty, git_diff_sha256: None each outside a git checkout
    }


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def _format_time_left(seconds: float) -> str:
    """A time left, to the precision that matters: 4m05s, 2h05m, 6d19h."""
    if round(seconds) < 3600:
        return _format_duration(seconds)
    hours, minutes = divmod(int(round(seconds / 60)), 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _format_clock(when: float, now: float) -> str:
    """A wall-clock time, local: 14:32 today, `Mar 05 14:32` on another day."""
    moment, today = datetime.datetime.fromtimestamp(when), datetime.datetime.fromtimestamp(now)
    return moment.strftime("%H:%M" if moment.date() == today.date() else "%b %d %H:%M")


def run_seconds_left(epochs_after: int, steps_per_epoch: int, seconds_per_step: float,
                     validation_seconds: float) -> float:
    """The expected wall time of the run's `epochs_after` epochs still to come
    after this one: their training steps at the measured mean step time (the
    warm-up left out) and a validation pass each, as long as the last one took."""
    return epochs_after * (steps_per_epoch * seconds_per_step + validation_seconds)


class ProgressMeter:
    """Progress lines of one split of one epoch, printed by the primary
    process, and the same figures per interval in TensorBoard. Loss and
    accuracy are running averages over this process's batches of the epoch
    so far; images/s is over the last print interval, for all processes
    (this process's rate x processes), and so is the share of wall time
    spent waiting for the next batch. An interval that holds warm-up steps
    says so. The time left (ETA) is the steps left at the mean step time
    measured so far in this split, warm-up left out: for the split, and on
    training lines for the run (`epochs`), with a validation pass per epoch
    as long as the last one (`validation_seconds`; none counted before the
    first)."""

    def __init__(self, split: str, epoch: int, steps: int, world_size: int,
                 writer=None, first_step: int = 0, epochs: Optional[int] = None, validation_seconds: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter, last_epoch_seconds_per_step: Optional[float] = None):
        self.split, self.epoch, self.steps, self.world_size = split, epoch, steps, world_size
        self.writer = writer
        self.epochs, self.validation_seconds = epochs, validation_seconds  # epochs: the run's (--epochs); None: unknown
        self.last_epoch_seconds_per_step = last_epoch_seconds_per_step  # the last training epoch's, warm-up included
        self.width = len(str(steps))
        self.first_step = first_step  # after a mid-epoch resume, the steps before it ran in an earlier process
        self.clock = clock  # seconds, for tests
        self.last_time = clock()
        self.last_count = 0
        self.last_step = first_step
        self.last_data_wait_seconds = 0.0

    def show(self, step: int, running: MetricTotals, timer: StepTimer, lr: Optional[float],
             precision_status: Optional[dict] = None) -> None:
        now = self.clock()
        interval_seconds = max(now - self.last_time, 1e-9)
        images_per_second = (running.count - self.last_count) * self.world_size / interval_seconds
        seconds_per_step = interval_seconds / max(step + 1 - self.last_step, 1)
        data_wait_share = (timer.all_data_wait_seconds - self.last_data_wait_seconds) / interval_seconds
        warmup = self.last_step - self.first_step < timer.warmup_steps
        self.last_time, self.last_count, self.last_step = now, running.count, step + 1
        self.last_data_wait_seconds = timer.all_data_wait_seconds
        line = (f"{self.split:5s} epoch {self.epoch} [{step + 1:{self.width}d}/{self.steps}]  "
                f"loss {running.loss:.4f}  top1 {running.top1:.2f}%  top5 {running.top5:.2f}%  "
                f"{images_per_second:.1f} img/s  {seconds_per_step:.3f} s/step  "
                f"data wait {100 * data_wait_share:.0f}%  mem {peak_memory_mib(timer.devices):.0f} MiB")
        if lr is not None:
            line += f"  lr {lr:.5f}"
        if precision_status:
            line += f"  loss scale {precision_status['loss_scale']:g} ({precision_status['skipped_steps']} skipped)"
        print(line + self.time_left(step, timer.mean_step_seconds()) + ("  (warm-up)" if warmup else ""), flush=True)
        if self.writer is not None:
            global_step = self.epoch * self.steps + step + 1
            for tag, value in ((f"Throughput/{self.split}_interval", images_per_second),
                               (f"Time/{self.split}_interval", seconds_per_step),
                               (f"Data/wait_fraction_{self.split}_interval", data_wait_share)):
                self.writer.add_scalar(tag, value, global_step=global_step)

    def time_left(self, step: int, seconds_per_step: Optional[float]) -> str:
        """`  ETA 2m05s (run 1h10m)` after step `step`; `  ETA --` while no
        step past the warm-up has been timed, in this epoch or (training) the
        last one. The epochs still to come are counted at the last epoch's
        wall time per step, its warm-up included, once there is one: each
        epoch has its warm-up too."""
        if self.split == "train" and seconds_per_step is None:
            seconds_per_step = self.last_epoch_seconds_per_step
        if seconds_per_step is None:
            return "  ETA --"
        split_seconds = (self.steps - step - 1) * seconds_per_step
        text = f"  ETA {_format_time_left(split_seconds)}"
        if self.split == "train" and self.epochs is not None:
            epochs_after = max(self.epochs - self.epoch - 1, 0)
            run_seconds = split_seconds + self.validation_seconds + run_seconds_left(
                epochs_after, self.steps, self.last_epoch_seconds_per_step or seconds_per_step,
                self.validation_seconds)
            text += f" (run {_format_time_left(run_seconds)})"
        return text


class _SilentProgress:
    def show(self, *args, **kwargs) -> None:
        pass


class RunLog:
    """Console, metrics.csv and TensorBoard sinks of one run. One class of
    ~240 lines because its methods are the events of a run (start, epoch end,
    unreadable images, evaluation, finish), each written to every sink by the
    primary alone, and each sink's write failures handled alike (see
    _writing): splitting it by sink would repeat those rules in each."""

    def __init__(self, ctx: Context, wall_clock: Callable[[], float] = time.time):
        self.ctx, self.is_primary = ctx, ctx.is_primary
        self.run_dir: Optional[Path] = None
        self._writer = None  # TensorBoard EventWriter, opened by start_run: x-axis epochs
        self._step_writer = None  # and one in steps/ for the per-interval curves: x-axis steps
        self._skips_explained = False
        self._per_replica = "per GPU" if ctx.device_kind == "gpu" else "per process"
        self.wall_clock = wall_clock
        self.epochs: Optional[int] = None  # the run's --epochs (start_run), for the time left; None: not known
        self._validation_seconds = 0.0  # the last validation pass's wall time, for the time left
        self._epoch_seconds_per_step: Optional[float] = None  # the last training epoch's wall time per step
        # Files of the run whose writes failed (a full disk), and why: each said once, and named at the finish.
        self.unwritten: Dict[str, str] = {}
        self.shows_sources = False  # lines and io.csv say where bytes came from: an object store, or a cache in use
        self._trackers = Trackers(self.info)  # --tracker: MLflow, W&B; opened by start_run

    def write_failed(self, name: str, why: str, later: Optional[str] = "its later writes are tried again "
                     "without a word") -> None:
        """A write of the run's file `name` failed (`why`: the error's text):
        warn the first time (the run goes on, the file keeps what it held;
        `later`: what becomes of its later writes, None: the caller warns),
        and note it for the finish."""
        if name not in self.unwritten and later is not None:
            self.info(one_line(f"warning: could not write {name} in {self.run_dir} ({why}); it keeps what it "
                               f"holds, {later}, and training goes on"))
        self.unwritten[name] = why

    @contextlib.contextmanager
    def _writing(self, name: str):
        """Write the run's file `name`: a failure is a warning (write_failed),
        not the end of the run; what the file held before is kept (appends
        are undone, other files replaced whole by a rename)."""
        try:
            yield
        except OSError as error:
            self.write_failed(name, error.strerror or str(error))

    def info(self, message: str) -> None:
        if self.is_primary:
            print(printable(message), flush=True)

    def explain_skipped_steps(self, precision_status: dict) -> None:
        """Say once, at the first skipped steps since this process started (a
        resumed run's earlier ones were explained before), that they are expected."""
        if self._skips_explained or not precision_status.get("skipped_since_start"):
            return
        self._skips_explained = True
        self.info(f"note: {precision_status['skipped_since_start']} step(s) skipped so far because fp16 gradients "
                  f"overflowed: normal while the loss scale finds its level (each skip halves it; now "
                  f"{precision_status['loss_scale']:g}), and now and then after it grows. Steps skipped in a "
                  f"row, or a scale that keeps falling, are not.")

    def progress_meter(self, split: str, epoch: int, steps: int, first_step: int = 0):
        if not self.is_primary:
            return _SilentProgress()
        return ProgressMeter(split, epoch, steps, self.ctx.world_size,
                             self._step_writer if split == "train" else None, first_step, self.epochs,
                             self._validation_seconds, last_epoch_seconds_per_step=self._epoch_seconds_per_step)

    def start_run(self, cfg: Config, start: ResumePoint, resolved: dict, run_dir: Optional[RunDirectory]) -> None:
        """Record the run's configuration in its directory (config.json, or a
        line of resumes.jsonl when it continues one) and open the TensorBoard
        writers there. `run_dir`: the primary's (common.rundir), None elsewhere."""
        if not self.is_primary or run_dir is None:
            return
        self.run_dir, self.epochs, self.shows_sources = run_dir.path, cfg.epochs, is_object_store(cfg.data)
        record = {
            "command": without_credentials(shlex.join([sys.executable] + sys.argv)),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "start_epoch": start.start_epoch,
            "start_step": start.step,
            "resumed_from": start.path,
            "options": cfg.to_dict(),
            "resolved": resolved,
            "environment": environment(self.ctx),
        }
        if cfg.recipe is not None:  # its name, file, source, every flag it set, and those the command line overrode
            record["recipe"] = recipes.record(cfg.recipe, cfg.recipe_overridden)
        # Written whole or not at all; one that cannot be written (a full disk) stops the run before it starts,
        # as the free-space check would have: without it, --resume auto would not know the directory.
        path = self.run_dir / ("resumes.jsonl" if run_dir.resuming else "config.json")
        try:
            if run_dir.resuming:
                append_whole(path, (json.dumps(record) + "\n").encode(), remove_if_new=True)
            else:
                atomic_write(path, lambda handle: handle.write((json.dumps(record, indent=2) + "\n").encode()))
        except OSError as error:
            raise UsageError(f"argument --logdir: cannot write {path} ({error.strerror or error}): free some "
                             f"space there or choose another --logdir") from None
        self._trackers.open(cfg.trackers, self.run_dir, record, run_dir.resuming)
        # purge_step hides events of epochs (and steps) that are now being redone; TensorBoard steps are
        # 1-based epochs here, and steps completed in steps/ (its own event file, as purging is per file).
        resuming = run_dir.resuming
        self._writer = EventWriter(self.run_dir, start.start_epoch + 1 if resuming else None,
                                   lambda why: self.write_failed("the TensorBoard events", why, _NO_MORE_EVENTS))
        steps_per_epoch = resolved.get("steps_per_epoch", 0)
        first_step = start.start_epoch * steps_per_epoch + start.step + 1
        self._step_writer = EventWriter(self.run_dir / "steps", first_step if resuming else None,
                                        lambda why: self.write_failed("the TensorBoard events of steps/", why,
                                                                         _NO_MORE_EVENTS))

    def io_samples(self, rows: List[dict]) -> None:
        """Append every node's I/O samples and bytes (common.measure.gather_io_rows) to io.csv."""
        self.shows_sources = self.shows_sources or any(row.get("cache_bytes") for row in rows)
        rows = [row for row in rows if self.shows_sources or row.get("kind") != "data"]
        if self.is_primary and self.run_dir is not None and rows:
            with self._writing("io.csv"):
                append_rows(self.run_dir / "io.csv", IO_COLUMNS, rows)

    def log_metrics(self, metrics: EpochMetrics) -> None:
        """Append one row to metrics.csv, the split's TensorBoard scalars and the trackers' metrics."""
        if not self.is_primary or self.run_dir is None:
            return
        row = dataclasses.asdict(metrics)
        with self._writing("metrics.csv"):
            append_rows(self.run_dir / "metrics.csv", METRICS_COLUMNS, [row])
        self._trackers.log(row)
        for tag, field in _SCALARS[metrics.split].items():
            value = getattr(metrics, field)
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=metrics.epoch + 1, walltime=metrics.wall_time)
        self._writer.flush()

    def epoch_end(self, train: EpochMetrics, val: EpochMetrics, report: ClassReport, classes: List[str],
                  best_acc1: float, best_epoch: Optional[int], ema: Optional[EpochMetrics] = None,
                  report_source: str = "model", best_source: Optional[str] = None) -> None:
        """The epoch's metrics rows, its per-class report (val_report.csv; also val_report_best.csv when this
        epoch is the best) and its lines; with --model-ema, `ema` (split val_ema), `report` `report_source`'s."""
        self.log_metrics(train)
        self.log_metrics(val)
        if ema is not None:
            self.log_metrics(ema)
        if self.is_primary and self.run_dir is not None:
            with self._writing("val_report.csv"):
                write_class_report(report, classes, val.epoch, self.run_dir / "val_report.csv",
                                   self.run_dir / "confusion_matrix.npy")
            if best_epoch == val.epoch:
                with self._writing("val_report_best.csv"):
                    write_class_report(report, classes, val.epoch, self.run_dir / "val_report_best.csv",
                                       self.run_dir / "confusion_matrix_best.npy")
        self._validation_seconds = val.seconds + (ema.seconds if ema is not None else 0.0)
        if train.steps:
            self._epoch_seconds_per_step = train.seconds / train.steps
        warmup = f" after {train.warmup_steps} warm-up steps" if train.warmup_steps else ""
        self.info(f"epoch {train.epoch} train: loss {train.loss:.4f}  top1 {train.top1:.2f}%  top5 {train.top5:.2f}%  "
                  f"| {train.images} images in {train.seconds:.1f} s; {train.images_per_second:.1f} img/s "
                  f"({train.images_per_second_per_gpu:.1f} {self._per_replica}), {train.seconds_per_step:.3f} s/step, "
                  f"data wait {100 * train.data_wait_fraction:.0f}%{warmup}; "
                  f"read {train.bytes_read(self.shows_sources)}, peak mem {train.peak_memory_mib:.0f} MiB, "
                  f"lr {train.lr:.5f}"
                  + (f", loss scale {train.loss_scale:g} ({train.skipped_steps} skipped)"
                     if train.loss_scale is not None else ""))
        lines = [f"epoch {row.epoch} {row.split + ':':6} loss {row.loss:.4f}  top1 {row.top1:.2f}%  top5 "
                 f"{row.top5:.2f}%  macro-F1 {row.macro_f1:.2f}%  | {row.images} images in {row.seconds:.1f} s"
                 for row in (val, ema) if row is not None]
        whose = f"  | per-class report: the {'EMA' if report_source == 'ema' else 'model'}" if ema else ""
        self.info("\n".join(lines) + f"{whose}  | best top1 {best_acc1:.2f}% (epoch {best_epoch}"
                  f"{', the EMA' if best_source == 'ema' else ''})" + self._run_end(train, val))
        if self.ctx.launcher_report is not None:  # every process, with the same figures
            self.ctx.launcher_report(epoch_report(train, val, best_acc1, ema))

    def _run_end(self, train: EpochMetrics, val: EpochMetrics) -> str:
        """`  | run ends ~ 14:32 (2h05m left)` after epoch `val.epoch`, from
        this epoch's wall time per step (warm-up included) and validation time;
        empty after the last epoch, or when --epochs is not known."""
        epochs_after = (self.epochs or 0) - val.epoch - 1
        if epochs_after <= 0:
            return ""
        seconds_per_step = train.seconds / max(train.steps, 1)  # wall time: each epoch has its warm-up too
        seconds_left = run_seconds_left(epochs_after, train.steps, seconds_per_step, self._validation_seconds)
        now = self.wall_clock()
        return f"  | run ends ~ {_format_clock(now + seconds_left, now)} ({_format_time_left(seconds_left)} left)"

    def bad_images(self, epoch: int, split: str, count: int, reasons: Dict[str, str]) -> None:
        """--bad-images skip: say how many unreadable images the split met, and
        list each file once in the run directory's bad_images.csv. `reasons`:
        every process's files (see data.BadImages); primary only."""
        if not self.is_primary:
            return
        what = "replaced by the next readable image" if split == "train" else "left out of the metrics"
        files = [f"{file} ({reason})" for file, reason in reasons.items()]
        if self.run_dir is not None:
            path = self.run_dir / "bad_images.csv"
            listed = set()
            if path.is_file():
                with open(path, **CSV_TEXT) as handle:
                    listed = {row["path"] for row in csv.DictReader(handle)}
            with self._writing("bad_images.csv"):
                append_rows(path, BAD_IMAGE_COLUMNS, [
                    {"path": file, "split": split, "first_epoch": epoch, "reason": reason}
                    for file, reason in reasons.items() if file not in listed])
            where = f"e.g. {files[0]}; all listed in {path}" if files else f"listed in {path}"
        else:
            shown = 5
            where = "; ".join(files[:shown]) + (f"; and {len(files) - shown} more" if len(files) > shown else "")
        self.info(one_line(f"epoch {epoch} {split}: {count} unreadable image file(s) {what} "
                           f"(--bad-images skip): {where}"))

    def evaluation(self, val: EpochMetrics, report: ClassReport, classes: List[str], report_dir: Optional[str] = None,
                   ema: Optional[EpochMetrics] = None, report_source: str = "model", set_name: str = "") -> None:
        """--evaluate's lines: the model's validation (of --eval-set `set_name`), and `ema`, the checkpoint's
        --model-ema average's if it holds one; `report`: `report_source`'s (the better top-1's), into `report_dir`."""
        for row in (val, ema) if ema is not None else (val,):
            self.info(f"{f'eval set {set_name}' if set_name else 'validation'}{' of the EMA' if row is ema else ''}: "
                      f"loss {row.loss:.4f}  top1 {row.top1:.2f}% ({round(row.top1 * row.images / 100)}/{row.images})  "
                      f"top5 {row.top5:.2f}%  macro-F1 {row.macro_f1:.2f}%  ({row.images} images in "
                      f"{row.seconds:.1f} s)")
        if self.is_primary and report_dir is not None:
            folder, prefix = Path(report_dir), f"{set_name}_" if set_name else ""  # val/: val_report.csv
            folder.mkdir(parents=True, exist_ok=True)
            csv_path, npy_path = folder / f"{prefix or 'val_'}report.csv", folder / f"{prefix}confusion_matrix.npy"
            write_class_report(report, classes, val.epoch, csv_path, npy_path)
            whose = f" of the {'EMA' if report_source == 'ema' else 'model'}" if ema is not None else ""
            self.info(f"per-class report{whose}: {csv_path} (confusion counts: {npy_path})")

    def end_trackers_after_error(self) -> None:
        """The run ended by an error, not through finish: each tracked run gets the reports written so far and
        ends FAILED, instead of staying RUNNING for good. Nothing after finish."""
        self._trackers.finish(stopped=True, failed=True)

    def finish(self, result, stopped: bool = False) -> None:
        """The closing lines: how long, how good, and where everything is.
        `stopped`: the run stops before its last epoch (a signal), to be continued."""
        for writer in (self._writer, self._step_writer):
            if writer is not None:
                writer.close()
        if not self.is_primary or self.run_dir is None:
            return
        self._trackers.finish(stopped)
        done = "stopped after" if stopped else "finished"
        best = (f"; best val top-1 {result.best_acc1:.2f}% at epoch {result.best_epoch}"
                + (" (the EMA)" if result.best_source == "ema" else "")
                if result.best_epoch is not None else "")
        self.info(f"{done} {result.epochs_run} epochs in {_format_duration(result.seconds)} ({result.seconds:.1f} s)"
                  f"{best}")

        run_dir = self.run_dir

        def entry(label: str, path: Path, detail: str, *names: str) -> Optional[str]:
            """A closing line for a file of the run: none for a file never written (a run stopped
            before its first epoch ended); marked where writes failed (a full disk)."""
            why = [self.unwritten[name] for name in names if name in self.unwritten]
            if not path.exists():
                return f"  {label + ':':13}{path} [NOT WRITTEN: {why[0]}]" if why else None
            return f"  {label + ':':13}{path}{detail}" + (f" [INCOMPLETE: writes failed ({why[0]})]" if why else "")

        best_report = " (best epoch: val_report_best.csv)" if (run_dir / "val_report_best.csv").exists() else ""
        best_checkpoint = "; best: model_best.pth.tar" if (run_dir / BEST_NAME).exists() else ""
        lines = [entry("metrics", run_dir / "metrics.csv", "", "metrics.csv"),
                 entry("config", run_dir / "config.json", ""),
                 entry("per class", run_dir / "val_report.csv", best_report, "val_report.csv", "val_report_best.csv"),
                 entry("checkpoints", run_dir / CHECKPOINT_NAME, f" (the newest{best_checkpoint})", "checkpoints"),
                 entry("I/O", run_dir / "io.csv", "", "io.csv"),
                 f"  {'TensorBoard:':13}tensorboard --logdir {run_dir.parent}"
                 + next((f" [INCOMPLETE: writes failed ({self.unwritten[name]})]" for name in
                         ("the TensorBoard events", "the TensorBoard events of steps/") if name in self.unwritten), "")]
        self.info("\n".join([f"run directory: {run_dir}", *(line for line in lines if line is not None)]))

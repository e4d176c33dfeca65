"""What a run tells the world: progress lines, the run directory, config.json,
metrics.csv and TensorBoard scalars. Only the primary process prints or
writes; on the others every call is a no-op.

A run directory holds everything about one run:
  config.json         every resolved option, the command, host, versions, device
  resumes.jsonl       one line per --resume into this directory (append-only)
  before-resume-*/    what a resume from an earlier epoch would otherwise overwrite
  metrics.csv         one row per epoch and split (columns: meters.EpochMetrics)
  io.csv              block-device read/write rates sampled on each node (IOSampler)
  val_report.csv      per-class precision, recall, F1, support of the last epoch; val_report_best.csv
                      of the best; confusion_matrix.npy, confusion_matrix_best.npy: their counts
  events.out.tfevents.*  TensorBoard scalars; the x-axis is epochs completed (1-based)
  steps/events.out.tfevents.*  the per-print-interval training curves (`*_interval`); x-axis: steps
  checkpoint.pth.tar, model_best.pth.tar

Timing costs no device synchronisation per step: the host reads the clock
when a batch arrives and when a step is queued; the device is synchronised
only where a measurement needs it (the end of the warm-up steps, and the
print intervals and epoch ends, which read the metrics anyway). So
`data wait` is the time the host waited for the input pipeline: when the
device is the bottleneck the host runs ahead and waits at those syncs
instead, and the share is small; when the pipeline is, it is large.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import resource
import shlex
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

import torch
import torchvision

from common.checkpoint import (BEST_NAME, CHECKPOINT_NAME, ResumePoint, auto_run_name, kept_checkpoints,
                               position_of)
from common.cli import Config, UsageError, one_line
from common.distributed import Context, all_reduce_max, all_reduce_sum, broadcast_from_primary, gather_to_primary
from common.meters import ClassReport, EpochMetrics, MetricTotals, SplitTiming

METRICS_COLUMNS = [field.name for field in dataclasses.fields(EpochMetrics)]
IO_COLUMNS = ["wall_time", "host", "device", "read_bytes_per_second", "write_bytes_per_second",
              "read_ops_per_second", "write_ops_per_second"]
MIB = 2 ** 20

# TensorBoard tag -> EpochMetrics field, per split; tags as in the upstream reference logs.
_SCALARS = {
    "train": {"Loss/train": "loss", "Top1/train": "top1", "Top5/train": "top5",
              "Throughput/train": "images_per_second", "Time/train": "seconds_per_step",
              "Data/wait_fraction": "data_wait_fraction", "Lr": "lr",
              "Amp/loss_scale": "loss_scale", "Amp/skipped_steps": "skipped_steps",
              "Throughput/train_per_gpu": "images_per_second_per_gpu", "Memory/peak_mib": "peak_memory_mib",
              "IO/dataset_bytes_train": "dataset_bytes", "Data/bad_images_train": "bad_images",
              "Memory/host_mib": "host_memory_mib"},
    "val": {"Loss/val": "loss", "Top1/val": "top1", "Top5/val": "top5",
            "Throughput/val": "images_per_second", "Time/val": "seconds_per_step", "F1/val_macro": "macro_f1",
            "Data/wait_fraction_val": "data_wait_fraction", "IO/dataset_bytes_val": "dataset_bytes",
            "Data/bad_images_val": "bad_images"},
}
BAD_IMAGE_COLUMNS = ["path", "split", "first_epoch", "reason"]


# --- timing, memory and I/O ---

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(devices: List[torch.device]) -> float:
    """On GPUs, the peak memory held by tensors since the last reset (the
    split's start: see StepTimer), the most on any of `devices`; on the CPU,
    the peak resident memory of this process since it started (data-loading
    workers not included)."""
    if devices[0].type == "cuda":
        return max(torch.cuda.max_memory_allocated(device) for device in devices) / MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def host_memory_mib() -> float:
    """This process's resident memory now (data-loading workers not
    included), from /proc; NaN where there is none. Unlike the peak it can
    fall, so a leak shows as growth from epoch to epoch."""
    try:
        with open("/proc/self/statm") as handle:
            resident_pages = int(handle.read().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB


class StepTimer:
    """Wall time of one split's steps on this process. The first
    `warmup_steps` are left out of the rates (start-up, cuDNN autotuning,
    workers filling their queues), unless the split has at most twice as
    many steps, when every step counts. Call batch_ready() when a batch
    arrives and step_done() when its step is queued."""

    def __init__(self, steps: int, warmup_steps: int, devices: List[torch.device]):
        # `steps`: the primary's count, the same on every process (validation shards can differ by a
        # batch), so all of them leave out the same warm-up and their timed images add up.
        self.warmup_steps = warmup_steps if steps > 2 * warmup_steps else 0
        self.device = devices[0]
        self.devices = devices
        if self.device.type == "cuda":
            for device in devices:
                torch.cuda.reset_peak_memory_stats(device)
        self.completed = 0
        self.data_wait_seconds = 0.0  # after the warm-up
        self.all_data_wait_seconds = 0.0  # every step, for the print intervals
        self.start = self.timed_start = self.step_end = time.perf_counter()

    @property
    def timing(self) -> bool:
        """Whether the current step counts for the rates (it is past the warm-up)."""
        return self.completed >= self.warmup_steps

    def batch_ready(self) -> None:
        wait = time.perf_counter() - self.step_end
        self.all_data_wait_seconds += wait
        if self.timing:
            self.data_wait_seconds += wait

    def step_done(self) -> None:
        self.completed += 1
        if self.completed == self.warmup_steps:
            synchronize(self.device)  # the warm-up's queued work is not billed to the timed steps
            self.timed_start = time.perf_counter()
        self.step_end = time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        """Leave what happens meanwhile (writing a checkpoint) out of every figure."""
        paused_at = time.perf_counter()
        try:
            yield
        finally:
            pause = time.perf_counter() - paused_at
            self.start += pause
            self.timed_start += pause
            self.step_end += pause

    def finish(self, ctx: Context, before: Optional[SplitTiming] = None) -> SplitTiming:
        """The split's timing; call after the epoch's metrics are reduced (which
        waits for the device and the slowest process). A collective: the peak
        memory is the maximum over processes, the data-wait share is over all
        of them (their waits summed over their timed wall times). `before`:
        the same split's timing up to a mid-epoch checkpoint this run resumed
        from, which the result includes (each part left out its own warm-up)."""
        now = time.perf_counter()
        timed_seconds = now - self.timed_start if self.timing else 0.0  # nothing is timed before the warm-up ends
        memory = torch.tensor([peak_memory_mib(self.devices), host_memory_mib()], dtype=torch.float64,
                              device=ctx.device)
        peak, host_memory = all_reduce_max(memory, ctx).tolist()
        # The data-wait share of all processes together: one slow input pipeline shows, not just the primary's.
        waits = torch.tensor([self.data_wait_seconds, timed_seconds], dtype=torch.float64, device=ctx.device)
        wait_seconds, all_timed_seconds = all_reduce_sum(waits, ctx).tolist()
        # A part that ends within its warm-up (a mid-epoch checkpoint) left out only the steps it ran.
        timing = SplitTiming(steps=self.completed, warmup_steps=min(self.warmup_steps, self.completed),
                             seconds=now - self.start,
                             timed_seconds=timed_seconds, data_wait_seconds=wait_seconds,
                             all_timed_seconds=all_timed_seconds, peak_memory_mib=peak,
                             host_memory_mib=host_memory)
        return timing.plus(before) if before is not None else timing


class DiskCounters(NamedTuple):
    """Cumulative counters of one block device, from /proc/diskstats."""

    major: int
    minor: int
    reads: int  # completed read operations
    read_bytes: int
    writes: int
    write_bytes: int


def read_diskstats(path: str = "/proc/diskstats") -> Dict[str, DiskCounters]:
    """Block devices by name; diskstats counts in 512-byte sectors, whatever
    the device's own sector size."""
    devices = {}
    with open(path) as handle:
        for line in handle:
            fields = line.split()
            if len(fields) >= 10:
                major, minor, name = int(fields[0]), int(fields[1]), fields[2]
                devices[name] = DiskCounters(major, minor, int(fields[3]), 512 * int(fields[5]), int(fields[7]),
                                             512 * int(fields[9]))
    return devices


def _filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    target, best, fstype = os.path.realpath(path), "", "unknown"
    try:
        with open(mountinfo) as handle:
            for line in handle:
                before, _, after = line.partition(" - ")
                mount_point = before.split()[4].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, after.split()[0]
    except (OSError, IndexError):
        pass
    return fstype


def block_device_of(path: str, diskstats: str = "/proc/diskstats") -> Tuple[Optional[str], str]:
    """The diskstats name of the block device holding `path`, or None and why
    there is none (a network or virtual file system: NFS, Lustre, GPFS,
    overlay, tmpfs, btrfs subvolumes)."""
    try:
        devices = read_diskstats(diskstats)
    except OSError as error:
        return None, f"no block-device counters on this system ({diskstats}: {error.strerror})"
    try:
        st_dev = os.stat(path).st_dev
    except OSError as error:  # say, a log directory that exists only on the primary's node
        return None, f"cannot see {path} on this node ({error.strerror})"
    for name, counters in devices.items():
        if (counters.major, counters.minor) == (os.major(st_dev), os.minor(st_dev)):
            return name, ""
    return None, f"no block-device counters for {path} (on a {_filesystem_type(path)} file system)"


class IOSampler:
    """Samples the read and write rates of the block device holding the
    dataset every `interval_seconds`, in a background thread (run on one
    process per node). Where there are no counters, each sample says so
    with empty values: missing, not zero. Nothing here raises."""

    def __init__(self, dataset_path: str, interval_seconds: float, diskstats: str = "/proc/diskstats",
                 clock=time.time):
        self.interval_seconds = interval_seconds
        self.diskstats, self.clock = diskstats, clock
        self.host = socket.gethostname().split(".")[0]
        self.device, self.missing_reason = block_device_of(dataset_path, diskstats)
        self.rows: List[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="io-sampler", daemon=True)
        self._last = self._read()

    def _read(self) -> Tuple[float, Optional[DiskCounters]]:
        """Now and the device's counters (None where there are none). Never
        raises: the sampler must not stop training, nor leave other
        processes waiting in a collective for this one."""
        try:
            counters = read_diskstats(self.diskstats).get(self.device) if self.device else None
        except (OSError, ValueError):
            counters = None
        return self.clock(), counters

    def sample(self) -> None:
        """Record the rates since the previous sample."""
        (then, before), (now, after) = self._last, self._read()
        self._last = (now, after)
        row = {"wall_time": round(now, 3), "host": self.host, "device": self.device or f"none: {self.missing_reason}"}
        if before is not None and after is not None and now > then:
            seconds = now - then
            row.update(read_bytes_per_second=(after.read_bytes - before.read_bytes) / seconds,
                       write_bytes_per_second=(after.write_bytes - before.write_bytes) / seconds,
                       read_ops_per_second=(after.reads - before.reads) / seconds,
                       write_ops_per_second=(after.writes - before.writes) / seconds)
        with self._lock:
            self.rows.append(row)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.sample()

    def start(self) -> "IOSampler":
        self._thread.start()
        return self

    def take_rows(self) -> List[dict]:
        with self._lock:
            rows, self.rows = self.rows, []
        return rows

    def stop(self) -> None:
        """Stop sampling; the time since the last sample becomes a last row if it is a second or more."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.clock() - self._last[0] >= 1.0:
            self.sample()


def write_class_report(report: ClassReport, classes: List[str], epoch: int, csv_path: Path, npy_path: Path) -> None:
    """val_report.csv (a row per class, then the macro and micro averages; in
    percent) and the confusion counts as .npy, each written whole and then
    renamed into place, so a reader never sees half a file."""
    temporary = csv_path.with_name(f".{csv_path.name}.tmp")
    with open(temporary, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["epoch", "class", "precision_percent", "recall_percent", "f1_percent", "support"])
        for name, precision, recall, f1, support in zip(classes, report.precision, report.recall, report.f1,
                                                          report.support):
            writer.writerow([epoch, name, f"{precision:.4f}", f"{recall:.4f}", f"{f1:.4f}", int(support)])
        present = int((report.support > 0).sum())
        writer.writerow([epoch, f"macro avg ({present} classes with images)", f"{report.macro(report.precision):.4f}",
                         f"{report.macro(report.recall):.4f}", f"{report.macro_f1:.4f}", int(report.support.sum())])
        writer.writerow([epoch, "micro avg", *(f"{report.micro:.4f}",) * 3, int(report.support.sum())])
    os.replace(temporary, csv_path)
    if report.confusion is None:  # too many classes to keep the matrix (MetricSums.CONFUSION_MAX_CLASSES)
        return
    temporary = npy_path.with_name(f".{npy_path.name}.tmp")
    with open(temporary, "wb") as handle:
        np.save(handle, report.confusion)
    os.replace(temporary, npy_path)


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
    """Host, versions and hardware, for config.json and RESULTS.md."""
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
    }


def default_run_name(cfg: Config, ctx: Context, when: datetime.datetime, host: str) -> str:
    """<Mon><DD>_<HH-MM-SS>_<host>_<arch>_<gpu|cpu>x<world>_b<batch>_cpu<workers>_opt<level>,
    the upstream convention (<world> counts GPUs, or CPU processes; cpu<workers> counts
    data-loading workers)."""
    return (f"{when.strftime('%b%d_%H-%M-%S')}_{host}_{cfg.arch}_{ctx.device_kind}x{ctx.replicas}"
            f"_b{cfg.batch_size}_cpu{cfg.workers}_opt{cfg.opt_level}")


def _make_run_directory(path: Path, flag: str) -> bool:
    """Create `path` if no other run has: mkdir is atomic, so two runs started
    in the same second never share a directory. Returns False when it exists."""
    try:
        path.mkdir(parents=True, exist_ok=False)
        return True
    except FileExistsError:
        return False
    except OSError as error:
        raise UsageError(f"argument {flag}: cannot create {path} ({error.strerror})") from None


def _run_directory(cfg: Config, ctx: Context) -> Tuple[Path, bool]:
    """Where this run writes, and whether it continues an existing run
    directory: --resume continues in the checkpoint's own run directory; a
    new run always gets a directory of its own."""
    logdir = Path(cfg.logdir)
    if cfg.resume == "auto":  # the same directory every time the job starts (see checkpoint.auto_run_name)
        run_dir = logdir / auto_run_name(cfg)
        if (run_dir / "config.json").is_file():
            return run_dir, True
        _make_run_directory(run_dir, "--logdir")  # or it is there, from a start that ended before config.json
        return run_dir, False
    resumed = Path(cfg.resume).resolve().parent if cfg.resume else None
    if resumed is not None and cfg.run_name is None and (resumed / "config.json").is_file():
        return resumed, True
    if cfg.run_name is not None:
        run_dir = logdir / cfg.run_name
        if resumed is not None and run_dir.is_dir() and resumed == run_dir.resolve():
            return run_dir, True
        if not _make_run_directory(run_dir, "--run-name"):
            raise UsageError(f"argument --run-name: {run_dir} already exists; continue it with "
                             f"--resume {run_dir / CHECKPOINT_NAME} or choose another name")
        return run_dir, False
    name = default_run_name(cfg, ctx, datetime.datetime.now(), socket.gethostname().split(".")[0])
    for attempt in itertools.count(1):
        run_dir = logdir / (name if attempt == 1 else f"{name}-{attempt}")
        if _make_run_directory(run_dir, "--logdir"):
            return run_dir, False


# Room for the logs besides the checkpoints: metrics, TensorBoard events, reports (a 90-epoch ImageNet run
# writes a few MiB).
LOG_ROOM_BYTES = 64 * MIB


def _check_room(run_dir: Path, resuming: bool, keep: int, checkpoint_bytes: Optional[int]) -> None:
    """Before training: the run directory is writable and its file system
    has room for the checkpoints to come, less those already there: the
    --keep-checkpoints files, the one being written before the oldest is
    deleted, and model_best.pth.tar, whose link keeps an otherwise deleted
    file on disk. A run that fails at its first checkpoint hours in wastes
    them. A new run's (still empty) directory is removed again when it fails."""
    try:
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise UsageError(f"argument --logdir: cannot write in {run_dir} (permission denied)")
        if checkpoint_bytes is None:
            return
        existing = len(kept_checkpoints(run_dir)) if resuming else 0
        files = max(1, keep + 2 - existing)
        needed = files * checkpoint_bytes + LOG_ROOM_BYTES
        free = shutil.disk_usage(run_dir).free
        if free < needed:
            raise UsageError(f"argument --logdir: {_format_bytes(free)} free where {run_dir} is; this run needs "
                             f"about {_format_bytes(needed)} ({files} more checkpoint files of "
                             f"{_format_bytes(checkpoint_bytes)} with --keep-checkpoints {keep}, and its logs): "
                             f"free some, lower --keep-checkpoints or choose another --logdir")
    except UsageError:
        if not resuming:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if still empty: nothing written is ever removed
        raise


def _preserve(source: Path, destination: Path) -> None:
    """Keep `source`'s current content at `destination`: a hard link where the
    file system allows (files here are replaced by rename, never rewritten in
    place, so the link keeps the old content), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def _rewrite_rows(path: Path, columns: List[str], rows: List[dict]) -> None:
    """Replace a CSV file by these rows under these columns (a new file
    renamed over it: later appends never reach a copy kept by a link)."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)


def _append_rows(path: Path, columns: List[str], rows: List[dict]) -> None:
    """Append rows to a CSV file, with the header when the file is new; a
    missing value is an empty cell. A file written with other columns (an
    older version's metrics.csv, being resumed) is first rewritten with these,
    its rows kept, so every row matches the header."""
    new_file = not path.is_file()
    if not new_file:
        with open(path, newline="") as handle:  # the header only, unless it differs (io.csv grows long)
            header = next(csv.reader(handle), None)
            old_rows = list(csv.DictReader(handle, fieldnames=header)) if header != columns else None
        if old_rows is not None:
            _rewrite_rows(path, columns, old_rows)
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        if new_file:
            writer.writeheader()
        writer.writerows(rows)


def _format_bytes(count: Optional[int]) -> str:
    if not count:
        return "0 B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000


class ProgressMeter:
    """Progress lines of one split of one epoch, printed by the primary
    process, and the same figures per interval in TensorBoard. Loss and
    accuracy are running averages over this process's batches of the epoch
    so far; images/s is over the last print interval, for all processes
    (this process's rate x processes), and so is the share of wall time
    spent waiting for the next batch. An interval that holds warm-up steps
    says so."""

    def __init__(self, split: str, epoch: int, steps: int, world_size: int, replicas: int, per_replica: str,
                 writer=None, first_step: int = 0):
        self.split, self.epoch, self.steps, self.world_size, self.replicas = split, epoch, steps, world_size, replicas
        self.per_replica = per_replica  # "per GPU", or "per process" on the CPU
        self.writer = writer
        self.width = len(str(steps))
        self.first_step = first_step  # after a mid-epoch resume, the steps before it ran in an earlier process
        self.last_time = time.perf_counter()
        self.last_count = 0
        self.last_step = first_step
        self.last_data_wait_seconds = 0.0

    def show(self, step: int, running: MetricTotals, timer: StepTimer, lr: Optional[float],
             precision_status: Optional[dict] = None) -> None:
        now = time.perf_counter()
        interval_seconds = max(now - self.last_time, 1e-9)
        images_per_second = (running.count - self.last_count) * self.world_size / interval_seconds
        seconds_per_step = interval_seconds / max(step + 1 - self.last_step, 1)
        data_wait_share = (timer.all_data_wait_seconds - self.last_data_wait_seconds) / interval_seconds
        warmup = self.last_step - self.first_step < timer.warmup_steps
        self.last_time, self.last_count, self.last_step = now, running.count, step + 1
        self.last_data_wait_seconds = timer.all_data_wait_seconds
        line = (f"{self.split:5s} epoch {self.epoch} [{step + 1:{self.width}d}/{self.steps}]  "
                f"loss {running.loss:.4f}  top1 {running.top1:6.2f}%  top5 {running.top5:6.2f}%  "
                f"{images_per_second:8.1f} img/s ({images_per_second / self.replicas:.1f} {self.per_replica})  "
                f"{seconds_per_step:.3f} s/step  data wait {100 * data_wait_share:3.0f}%  "
                f"mem {peak_memory_mib(timer.devices):.0f} MiB")
        if lr is not None:
            line += f"  lr {lr:.5f}"
        if precision_status:
            line += f"  loss scale {precision_status['loss_scale']:g} ({precision_status['skipped_steps']} skipped)"
        print(line + ("  (warm-up)" if warmup else ""), flush=True)
        if self.writer is not None:
            global_step = self.epoch * self.steps + step + 1
            for tag, value in ((f"Throughput/{self.split}_interval", images_per_second),
                               (f"Time/{self.split}_interval", seconds_per_step),
                               (f"Data/wait_fraction_{self.split}_interval", data_wait_share)):
                self.writer.add_scalar(tag, value, global_step=global_step)


class _SilentProgress:
    def show(self, *args, **kwargs) -> None:
        pass


class RunLog:
    """Console, metrics.csv and TensorBoard sinks of one run."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.is_primary = ctx.is_primary
        self.run_dir: Optional[Path] = None
        self._writer = None  # TensorBoard SummaryWriter, opened by start_run: x-axis epochs
        self._step_writer = None  # and one in steps/ for the per-interval curves: x-axis steps
        self._skips_explained = False
        self._io_sampler: Optional[IOSampler] = None  # on local rank 0 of each node, from start_run
        self._per_replica = "per GPU" if ctx.device_kind == "gpu" else "per process"

    def info(self, message: str) -> None:
        if self.is_primary:
            print(message, flush=True)

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
        return ProgressMeter(split, epoch, steps, self.ctx.world_size, self.ctx.replicas, self._per_replica,
                             self._step_writer if split == "train" else None, first_step)

    def start_run(self, cfg: Config, start: ResumePoint, resolved: dict) -> Optional[Path]:
        """Create (or, on --resume, reopen) the run directory and record the
        run's configuration. Returns the directory (None off the primary).
        Every process calls it: the primary's failure (say, --run-name taken)
        is raised on all of them, so none is left waiting for the others."""
        failure = None
        if self.is_primary:
            try:
                run_dir, resuming = _run_directory(cfg, self.ctx)
                _check_room(run_dir, resuming, cfg.keep_checkpoints, resolved.get("checkpoint_bytes"))
            except UsageError as error:
                failure = str(error)
        failure = broadcast_from_primary(failure, self.ctx)
        if failure is not None:
            raise UsageError(failure)
        self._start_io_sampler(cfg)
        if not self.is_primary:
            return None
        self.run_dir = run_dir
        record = {
            "command": shlex.join([sys.executable] + sys.argv),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "start_epoch": start.start_epoch,
            "start_step": start.step,
            "resumed_from": start.path,
            "options": cfg.to_dict(),
            "resolved": resolved,
            "environment": environment(self.ctx),
        }
        if resuming:
            with open(run_dir / "resumes.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self._set_aside_later_epochs(start)
        else:
            with open(run_dir / "config.json", "w") as handle:
                json.dump(record, handle, indent=2)
                handle.write("\n")
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

        # purge_step hides events of epochs (and steps) that are now being redone; TensorBoard steps are
        # 1-based epochs here, and steps completed in steps/ (its own event file, as purging is per file).
        self._writer = SummaryWriter(log_dir=str(run_dir), purge_step=start.start_epoch + 1 if resuming else None)
        steps_per_epoch = resolved.get("steps_per_epoch", 0)
        first_step = start.start_epoch * steps_per_epoch + start.step + 1
        self._step_writer = SummaryWriter(log_dir=str(run_dir / "steps"), purge_step=first_step if resuming else None)
        return run_dir

    def _start_io_sampler(self, cfg: Config) -> None:
        """One process per node samples (local rank 0): the dataset's
        device, or for --synthetic runs the log directory's."""
        if cfg.io_interval <= 0 or self.ctx.local_rank != 0:
            return
        # The device of train/ (where almost all reads go; it may be a link to another disk than DATA's).
        path = cfg.logdir if cfg.synthetic else os.path.join(cfg.data, "train")
        self._io_sampler = IOSampler(path, cfg.io_interval).start()
        if self._io_sampler.device is None:
            print(f"note: I/O sampling on {self._io_sampler.host}: {self._io_sampler.missing_reason}; io.csv "
                  f"marks its samples missing (the bytes the input pipeline read are in metrics.csv, "
                  f"dataset_bytes)", flush=True)

    def _write_io_samples(self) -> None:
        """Bring every node's I/O samples to the primary (a collective) and append them to io.csv."""
        rows = self._io_sampler.take_rows() if self._io_sampler is not None else []
        gathered = [row for rank_rows in gather_to_primary(rows, self.ctx) for row in rank_rows]
        if not self.is_primary or self.run_dir is None or not gathered:
            return
        _append_rows(self.run_dir / "io.csv", IO_COLUMNS, gathered)

    def _set_aside_later_epochs(self, start: ResumePoint) -> None:
        """Resuming from an earlier position than the run directory reached
        (say, from model_best.pth.tar, or from the previous checkpoint when the
        newest is damaged): what comes after it runs again. Its metrics rows
        and the newer checkpoints are kept in before-resume-<time>/ first
        (the newer checkpoint files are moved there, so that checkpoint
        rotation, which keeps the newest, cannot prefer them to this run's),
        then metrics.csv keeps the earlier rows."""
        path = self.run_dir / "metrics.csv"
        rows = []
        if path.is_file():
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
        kept = [row for row in rows if int(row["epoch"]) < start.start_epoch]
        later_checkpoints = [checkpoint for checkpoint in kept_checkpoints(self.run_dir)
                             if position_of(checkpoint) > (start.start_epoch, start.images_done)]
        if len(kept) == len(rows) and not later_checkpoints:
            return
        stamp = f"before-resume-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        backup, attempt = self.run_dir / stamp, 1
        while backup.exists():  # two resumes within a second keep both backups
            attempt += 1
            backup = self.run_dir / f"{stamp}-{attempt}"
        backup.mkdir()
        for name in ("metrics.csv", CHECKPOINT_NAME, BEST_NAME, "val_report.csv", "val_report_best.csv",
                     "confusion_matrix.npy", "confusion_matrix_best.npy"):
            if (self.run_dir / name).is_file():
                _preserve(self.run_dir / name, backup / name)
        newest = self.run_dir / CHECKPOINT_NAME
        if later_checkpoints and newest.is_file() and not (start.path and os.path.samefile(newest, start.path)):
            newest.unlink()  # a later state (kept in the backup): the next save makes it anew
        for checkpoint in later_checkpoints:
            os.replace(checkpoint, backup / checkpoint.name)
        if len(kept) != len(rows):
            _rewrite_rows(path, METRICS_COLUMNS, kept)  # the preserved copy keeps the later rows
        self.info(f"resuming at epoch {start.start_epoch} step {start.step}, before {len(rows) - len(kept)} later "
                  f"metrics rows and {len(later_checkpoints)} later checkpoints of {self.run_dir.name}: they are "
                  f"kept in {backup}")

    def log_metrics(self, metrics: EpochMetrics) -> None:
        """Append one row to metrics.csv and the split's TensorBoard scalars."""
        if not self.is_primary or self.run_dir is None:
            return
        _append_rows(self.run_dir / "metrics.csv", METRICS_COLUMNS, [dataclasses.asdict(metrics)])
        for tag, field in _SCALARS[metrics.split].items():
            value = getattr(metrics, field)
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=metrics.epoch + 1, walltime=metrics.wall_time)
        self._writer.flush()

    def epoch_end(self, train: EpochMetrics, val: EpochMetrics, report: ClassReport, classes: List[str],
                  best_acc1: float, best_epoch: Optional[int]) -> None:
        """Every process calls it (the I/O samples are gathered); the primary
        writes the metrics, the per-class report (val_report.csv; also
        val_report_best.csv when this epoch is the best) and the I/O samples."""
        self._write_io_samples()
        self.log_metrics(train)
        self.log_metrics(val)
        if self.is_primary and self.run_dir is not None:
            write_class_report(report, classes, val.epoch, self.run_dir / "val_report.csv",
                               self.run_dir / "confusion_matrix.npy")
            if best_epoch == val.epoch:
                write_class_report(report, classes, val.epoch, self.run_dir / "val_report_best.csv",
                                   self.run_dir / "confusion_matrix_best.npy")
        warmup = f" after {train.warmup_steps} warm-up steps" if train.warmup_steps else ""
        self.info(f"epoch {train.epoch} train: loss {train.loss:.4f}  top1 {train.top1:.2f}%  top5 {train.top5:.2f}%  "
                  f"| {train.images} images in {train.seconds:.1f} s; {train.images_per_second:.1f} img/s "
                  f"({train.images_per_second_per_gpu:.1f} {self._per_replica}), {train.seconds_per_step:.3f} s/step, "
                  f"data wait {100 * train.data_wait_fraction:.0f}%{warmup}; read {_format_bytes(train.dataset_bytes)}, "
                  f"peak mem {train.peak_memory_mib:.0f} MiB, lr {train.lr:.5f}"
                  + (f", loss scale {train.loss_scale:g} ({train.skipped_steps} skipped)"
                     if train.loss_scale is not None else ""))
        self.info(f"epoch {val.epoch} val:   loss {val.loss:.4f}  top1 {val.top1:.2f}%  top5 {val.top5:.2f}%  "
                  f"macro-F1 {val.macro_f1:.2f}%  | {val.images} images in {val.seconds:.1f} s  "
                  f"| best top1 {best_acc1:.2f}% (epoch {best_epoch})")

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
                with open(path, newline="") as handle:
                    listed = {row["path"] for row in csv.DictReader(handle)}
            _append_rows(path, BAD_IMAGE_COLUMNS, [
                {"path": file, "split": split, "first_epoch": epoch, "reason": reason}
                for file, reason in reasons.items() if file not in listed])
            where = f"e.g. {files[0]}; all listed in {path}" if files else f"listed in {path}"
        else:
            shown = 5
            where = "; ".join(files[:shown]) + (f"; and {len(files) - shown} more" if len(files) > shown else "")
        self.info(one_line(f"epoch {epoch} {split}: {count} unreadable image file(s) {what} "
                           f"(--bad-images skip): {where}"))

    def evaluation(self, val: EpochMetrics, report: ClassReport, classes: List[str],
                   report_dir: Optional[str] = None) -> None:
        top1_correct = round(val.top1 * val.images / 100)
        self.info(f"validation: loss {val.loss:.4f}  top1 {val.top1:.2f}% ({top1_correct}/{val.images})  "
                  f"top5 {val.top5:.2f}%  macro-F1 {val.macro_f1:.2f}%  ({val.images} images in {val.seconds:.1f} s)")
        if self.is_primary and report_dir is not None:
            folder = Path(report_dir)
            folder.mkdir(parents=True, exist_ok=True)
            write_class_report(report, classes, val.epoch, folder / "val_report.csv", folder / "confusion_matrix.npy")
            self.info(f"per-class report: {folder / 'val_report.csv'} (confusion counts: "
                      f"{folder / 'confusion_matrix.npy'})")

    def finish(self, result, stopped: bool = False) -> None:
        """The closing lines: how long, how good, and where everything is.
        Every process calls it (the last I/O samples are gathered). `stopped`:
        the run stops before its last epoch (a signal), to be continued."""
        if self._io_sampler is not None:
            self._io_sampler.stop()
        self._write_io_samples()
        for writer in (self._writer, self._step_writer):
            if writer is not None:
                writer.close()
        if not self.is_primary or self.run_dir is None:
            return
        done = "stopped after" if stopped else "finished"
        best = (f"; best val top-1 {result.best_acc1:.2f}% at epoch {result.best_epoch}"
                if result.best_epoch is not None else "")
        self.info(f"{done} {result.epochs_run} epochs in {_format_duration(result.seconds)} ({result.seconds:.1f} s)"
                  f"{best}")
        self.info(f"run directory: {self.run_dir}\n"
                  f"  metrics:     {self.run_dir / 'metrics.csv'}\n"
                  f"  config:      {self.run_dir / 'config.json'}\n"
                  f"  per class:   {self.run_dir / 'val_report.csv'} (best epoch: val_report_best.csv)\n"
                  f"  checkpoints: {self.run_dir / CHECKPOINT_NAME} (the newest; best: model_best.pth.tar)\n"
                  f"  TensorBoard: tensorboard --logdir {self.run_dir.parent}")

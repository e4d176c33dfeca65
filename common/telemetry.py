"""What a run tells the world: progress lines, the run directory, config.json,
metrics.csv and TensorBoard scalars. Only the primary process prints or
writes; on the others every call is a no-op.

A run directory holds everything about one run:
  config.json         every resolved option, the command, host, versions, device
  resumes.jsonl       one line per --resume into this directory (append-only)
  before-resume-*/    what a resume from an earlier epoch would otherwise overwrite
  metrics.csv         one row per epoch and split (columns: meters.EpochMetrics)
  events.out.tfevents.*  TensorBoard scalars; the x-axis is epochs completed (1-based)
  checkpoint.pth.tar, model_best.pth.tar
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import itertools
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

import torch
import torchvision

from common.checkpoint import BEST_NAME, CHECKPOINT_NAME
from common.cli import Config, UsageError
from common.distributed import Context, broadcast_from_primary
from common.meters import EpochMetrics, MetricTotals

METRICS_COLUMNS = [field.name for field in dataclasses.fields(EpochMetrics)]

# TensorBoard tag -> EpochMetrics field, per split; tags as in the upstream reference logs.
_SCALARS = {
    "train": {"Loss/train": "loss", "Top1/train": "top1", "Top5/train": "top5",
              "Throughput/train": "images_per_second", "Time/train": "seconds_per_step",
              "Data/wait_fraction": "data_wait_fraction", "Lr": "lr",
              "Amp/loss_scale": "loss_scale", "Amp/skipped_steps": "skipped_steps"},
    "val": {"Loss/val": "loss", "Top1/val": "top1", "Top5/val": "top5",
            "Throughput/val": "images_per_second", "Time/val": "seconds_per_step"},
}


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


class ProgressMeter:
    """Progress lines of one split of one epoch, printed by the primary process.
    Loss and accuracy are running averages over this process's batches of
    the epoch so far; images/s is over the last print interval, for all
    processes (this process's rate x world size), and so is the share of
    wall time spent waiting for the next batch."""

    def __init__(self, split: str, epoch: int, steps: int, world_size: int):
        self.split, self.epoch, self.steps, self.world_size = split, epoch, steps, world_size
        self.width = len(str(steps))
        self.last_time = time.perf_counter()
        self.last_count = 0
        self.last_data_wait_seconds = 0.0

    def show(self, step: int, running: MetricTotals, data_wait_seconds: float, lr: Optional[float],
             precision_status: Optional[dict] = None) -> None:
        now = time.perf_counter()
        interval_seconds = max(now - self.last_time, 1e-9)
        images_per_second = (running.count - self.last_count) * self.world_size / interval_seconds
        data_wait_share = (data_wait_seconds - self.last_data_wait_seconds) / interval_seconds
        self.last_time, self.last_count, self.last_data_wait_seconds = now, running.count, data_wait_seconds
        line = (f"{self.split:5s} epoch {self.epoch} [{step + 1:{self.width}d}/{self.steps}]  "
                f"loss {running.loss:.4f}  top1 {running.top1:6.2f}%  top5 {running.top5:6.2f}%  "
                f"{images_per_second:8.1f} img/s  data wait {100 * data_wait_share:3.0f}%")
        if lr is not None:
            line += f"  lr {lr:.5f}"
        if precision_status:
            line += f"  loss scale {precision_status['loss_scale']:g} ({precision_status['skipped_steps']} skipped)"
        print(line, flush=True)


class _SilentProgress:
    def show(self, *args, **kwargs) -> None:
        pass


class RunLog:
    """Console, metrics.csv and TensorBoard sinks of one run."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.is_primary = ctx.is_primary
        self.run_dir: Optional[Path] = None
        self._writer = None  # TensorBoard SummaryWriter, opened by start_run
        self._skips_explained = False

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

    def progress_meter(self, split: str, epoch: int, steps: int, world_size: int):
        return ProgressMeter(split, epoch, steps, world_size) if self.is_primary else _SilentProgress()

    def start_run(self, cfg: Config, start_epoch: int, resolved: dict) -> Optional[Path]:
        """Create (or, on --resume, reopen) the run directory and record the
        run's configuration. Returns the directory (None off the primary).
        Every process calls it: the primary's failure (say, --run-name taken)
        is raised on all of them, so none is left waiting for the others."""
        failure = None
        if self.is_primary:
            try:
                run_dir, resuming = _run_directory(cfg, self.ctx)
            except UsageError as error:
                failure = str(error)
        failure = broadcast_from_primary(failure, self.ctx)
        if failure is not None:
            raise UsageError(failure)
        if not self.is_primary:
            return None
        self.run_dir = run_dir
        record = {
            "command": shlex.join([sys.executable] + sys.argv),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "start_epoch": start_epoch,
            "options": cfg.to_dict(),
            "resolved": resolved,
            "environment": environment(self.ctx),
        }
        if resuming:
            with open(run_dir / "resumes.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self._set_aside_later_epochs(start_epoch)
        else:
            with open(run_dir / "config.json", "w") as handle:
                json.dump(record, handle, indent=2)
                handle.write("\n")
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

        # purge_step hides events of epochs that are now being redone; TensorBoard steps are 1-based epochs.
        self._writer = SummaryWriter(log_dir=str(run_dir), purge_step=start_epoch + 1 if resuming else None)
        return run_dir

    def _set_aside_later_epochs(self, start_epoch: int) -> None:
        """Resuming from an earlier epoch than the run directory reached (say,
        from model_best.pth.tar): the epochs from `start_epoch` on run again.
        Their metrics rows and the newer checkpoints are kept in
        before-resume-<time>/ first, then metrics.csv keeps the earlier rows."""
        path = self.run_dir / "metrics.csv"
        if not path.is_file():
            return
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        kept = [row for row in rows if int(row["epoch"]) < start_epoch]
        if len(kept) == len(rows):
            return
        backup = self.run_dir / f"before-resume-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        backup.mkdir()
        for name in ("metrics.csv", CHECKPOINT_NAME, BEST_NAME):
            if (self.run_dir / name).is_file():
                _preserve(self.run_dir / name, backup / name)
        # A new file renamed over metrics.csv: later appends must not reach the preserved copy.
        temporary = path.with_name(".metrics.csv.tmp")
        with open(temporary, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=METRICS_COLUMNS)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(temporary, path)
        self.info(f"resuming at epoch {start_epoch}, before the {len(rows) - len(kept)} later metrics rows of "
                  f"{self.run_dir.name}: they and the newer checkpoints are kept in {backup}")

    def log_metrics(self, metrics: EpochMetrics) -> None:
        """Append one row to metrics.csv and the split's TensorBoard scalars."""
        if not self.is_primary or self.run_dir is None:
            return
        path = self.run_dir / "metrics.csv"
        new_file = not path.is_file()
        with open(path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=METRICS_COLUMNS)
            if new_file:
                writer.writeheader()
            writer.writerow(dataclasses.asdict(metrics))
        for tag, field in _SCALARS[metrics.split].items():
            value = getattr(metrics, field)
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=metrics.epoch + 1, walltime=metrics.wall_time)
        self._writer.flush()

    def epoch_end(self, train: EpochMetrics, val: EpochMetrics, best_acc1: float, best_epoch: Optional[int]) -> None:
        self.log_metrics(train)
        self.log_metrics(val)
        self.info(f"epoch {train.epoch} train: loss {train.loss:.4f}  top1 {train.top1:.2f}%  top5 {train.top5:.2f}%  "
                  f"| {train.images} images in {train.seconds:.1f} s: {train.images_per_second:.1f} img/s, "
                  f"{train.seconds_per_step:.3f} s/step, data wait {100 * train.data_wait_fraction:.0f}%, "
                  f"lr {train.lr:.5f}" + (f", loss scale {train.loss_scale:g} ({train.skipped_steps} skipped)"
                                          if train.loss_scale is not None else ""))
        self.info(f"epoch {val.epoch} val:   loss {val.loss:.4f}  top1 {val.top1:.2f}%  top5 {val.top5:.2f}%  "
                  f"| {val.images} images in {val.seconds:.1f} s  | best top1 {best_acc1:.2f}% (epoch {best_epoch})")

    def evaluation(self, val: EpochMetrics) -> None:
        top1_correct = round(val.top1 * val.images / 100)
        self.info(f"validation: loss {val.loss:.4f}  top1 {val.top1:.2f}% ({top1_correct}/{val.images})  "
                  f"top5 {val.top5:.2f}%  ({val.images} images in {val.seconds:.1f} s)")

    def finish(self, result) -> None:
        """The closing lines: how long, how good, and where everything is."""
        if self._writer is not None:
            self._writer.close()
        if not self.is_primary or self.run_dir is None:
            return
        self.info(f"finished {result.epochs_run} epochs in {_format_duration(result.seconds)} "
                  f"({result.seconds:.1f} s); best val top-1 {result.best_acc1:.2f}% at epoch {result.best_epoch}")
        self.info(f"run directory: {self.run_dir}\n"
                  f"  metrics:     {self.run_dir / 'metrics.csv'}\n"
                  f"  config:      {self.run_dir / 'config.json'}\n"
                  f"  checkpoints: {self.run_dir / CHECKPOINT_NAME} (best: model_best.pth.tar)\n"
                  f"  TensorBoard: tensorboard --logdir {self.run_dir.parent}")

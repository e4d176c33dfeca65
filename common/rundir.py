"""The run directory: the one owner of where a run writes, what its files are
called, which checkpoint files are kept, and what a resume sets aside.

A run directory holds everything about one run (the table is in
docs/outputs.md): config.json, resumes.jsonl, metrics.csv, io.csv,
bad_images.csv, val_report*.csv, confusion_matrix*.npy, TensorBoard events
(and steps/ for per-interval curves), the checkpoint files and
before-resume-*/ folders. Its default name follows the upstream convention,
so old and new runs sort together:
<Mon><DD>_<HH-MM-SS>_<host>_<arch>_<gpu|cpu>x<world>_b<batch>_cpu<workers>_opt<level>.

Checkpoints: each is a file of its own, checkpoint-epoch<E>-images<N>.pth.tar
(E: the epoch in progress, N: its images done, all processes together);
checkpoint.pth.tar is always the newest (a hard link, or a copy where the
file system has none), model_best.pth.tar the best epoch's, and only the
newest --keep-checkpoints files are kept. Every file is written under a
temporary name, flushed and renamed (common.files.atomic_write): a crash
mid-write leaves the previous one intact. Nothing already written is overwritten or deleted silently.
Used by common.checkpoint (saving into it) and common.telemetry (logging
into it); the primary process alone writes.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import BinaryIO, Callable, List, Mapping, Optional, Tuple

from common.config import Config
from common.distributed import Context, broadcast_from_primary
from common.errors import UsageError, error_summary
from common.files import (MIB, TEMPORARY_NAME, atomic_write, format_bytes, link_atomically, read_whole_rows,
                          rewrite_rows)
from common.launcher import ray_train_context, restart_name

CHECKPOINT_NAME = "checkpoint.pth.tar"  # the newest state (names as in pytorch/examples)
BEST_NAME = "model_best.pth.tar"  # the state of the epoch with the best validation top-1
_KEPT_NAME = re.compile(r"^checkpoint-epoch(\d+)-images(\d+)\.pth\.tar$")
LOCK_NAME = "run.lock"  # held by the run writing in the directory (RunLock)
# What a resume from an earlier position sets aside (besides the newer checkpoint files).
_RESULT_FILES = ("metrics.csv", CHECKPOINT_NAME, BEST_NAME, "val_report.csv", "val_report_best.csv",
                 "confusion_matrix.npy", "confusion_matrix_best.npy")
# Room for the logs besides the checkpoints: metrics, TensorBoard events, reports (a 90-epoch ImageNet run
# writes a few MiB).
LOG_ROOM_BYTES = 64 * MIB


# --- checkpoint file names ---

def kept_name(epoch: int, images_done: int) -> str:
    """The file name of the checkpoint taken with `images_done` images of epoch
    `epoch` trained on. Images, not steps: a resume with another global batch
    numbers its steps differently, but names must keep sorting by progress."""
    return f"checkpoint-epoch{epoch:03d}-images{images_done:08d}.pth.tar"


def position_of(path: Path) -> Optional[Tuple[int, int]]:
    """(epoch, images done) of a checkpoint-epoch<E>-images<N>.pth.tar file; None for other names."""
    match = _KEPT_NAME.match(Path(path).name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def kept_checkpoints(run_dir: Path) -> List[Path]:
    """The run directory's checkpoint-epoch*-images*.pth.tar files, newest first:
    regular files only (opening a FIFO of that name would wait forever)."""
    found = [path for path in Path(run_dir).iterdir() if position_of(path) is not None and path.is_file()]
    return sorted(found, key=position_of, reverse=True)


def add_checkpoint(run_dir: Path, epoch: int, images_done: int, write: Callable[[BinaryIO], None], is_best: bool,
                   keep: int) -> Path:
    """Write a checkpoint file with `write`, make checkpoint.pth.tar (and,
    when it is the best so far, model_best.pth.tar) that file, and delete all
    but the newest `keep` checkpoint files. Returns the new file's path."""
    run_dir = Path(run_dir)
    path = run_dir / kept_name(epoch, images_done)
    atomic_write(path, write)
    link_atomically(path, run_dir / CHECKPOINT_NAME)
    if is_best:
        link_atomically(path, run_dir / BEST_NAME)
    for old in kept_checkpoints(run_dir)[keep:]:
        old.unlink()
    return path


# --- which directory ---

def auto_run_name(cfg: Config, environ: Mapping[str, str] = os.environ) -> str:
    """The run directory's name for --resume auto: one that is the same when
    the job starts again (requeued by Slurm, restarted by torchrun or Ray)."""
    if cfg.run_name is not None:
        return cfg.run_name
    name = restart_name(environ, ray_train_context())
    if name is None:
        raise UsageError("argument --resume: auto needs a run directory that stays the same when the job starts "
                         "again: pass --run-name NAME (under Slurm the job id names it)")
    return name


def auto_run_directory(cfg: Config) -> Path:
    """Where --resume auto continues: the same directory each time the job starts."""
    return Path(cfg.logdir) / auto_run_name(cfg)


def default_run_name(cfg: Config, ctx: Context, when: datetime.datetime, host: str) -> str:
    """<Mon><DD>_<HH-MM-SS>_<host>_<arch>_<gpu|cpu>x<world>_b<batch>_cpu<workers>_opt<level>,
    the upstream convention (<world> counts GPUs, or CPU processes; cpu<workers> counts
    data-loading workers)."""
    arch = cfg.arch.replace("/", "-")  # timm/NAME: one folder, not a folder timm and NAME's under it
    return (f"{when.strftime('%b%d_%H-%M-%S')}_{host}_{arch}_{ctx.device_kind}x{ctx.replicas}"
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


def _choose_directory(cfg: Config, ctx: Context) -> Tuple[Path, bool]:
    """Where this run writes, and whether it continues an existing run
    directory: --resume continues in the checkpoint's own run directory; a
    new run always gets a directory of its own."""
    logdir = Path(cfg.logdir)
    if cfg.resume == "auto":  # the same directory every time the job starts (see auto_run_name)
        run_dir = auto_run_directory(cfg)
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


def _outermost_missing(folder: Path) -> Optional[Path]:
    """The outermost of `folder` and its parents that does not exist yet: what making it creates."""
    missing = None
    for candidate in (folder.absolute(), *folder.absolute().parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _remove_empty_folders(run_dir: Path, made_from: Optional[Path]) -> None:
    """A start that failed before writing anything leaves no trace: the new
    run directory, then the folders made for it up to `made_from`, each only
    while empty (nothing written is ever removed)."""
    folder = run_dir.absolute()
    outermost = made_from if made_from is not None else folder
    while True:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == outermost or outermost not in folder.parents:
            return
        folder = folder.parent


def _check_writable(run_dir: Path) -> None:
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"argument --logdir: cannot write in {run_dir} (permission denied)")


def _check_room(run_dir: Path, resuming: bool, keep: int, checkpoint_bytes: Optional[int],
                stuck_temporaries: List[Tuple[Path, int]]) -> None:
    """Before training: the run directory's file system has room for the
    checkpoints to come, less those already there: the --keep-checkpoints
    files, the one being written before the oldest is deleted, and
    model_best.pth.tar, whose link keeps an otherwise deleted file on disk.
    A run that fails at its first checkpoint hours in wastes them.
    `stuck_temporaries`: files of interrupted saves that could not be
    removed, (path, bytes): named when the room is short, as what to free."""
    if checkpoint_bytes is None:
        return
    existing = len(kept_checkpoints(run_dir)) if resuming else 0
    files = max(1, keep + 2 - existing)
    needed = files * checkpoint_bytes + LOG_ROOM_BYTES
    free = shutil.disk_usage(run_dir).free
    if free < needed:
        stuck = ""
        if stuck_temporaries:
            stuck = (f"; {_temporary_files(len(stuck_temporaries))} of interrupted saves there hold "
                     f"{format_bytes(sum(size for _, size in stuck_temporaries))} and could not be removed "
                     f"(such as {stuck_temporaries[0][0]})")
        raise UsageError(f"argument --logdir: {format_bytes(free)} free where {run_dir} is; this run needs "
                         f"about {format_bytes(needed)} ({files} more checkpoint files of "
                         f"{format_bytes(checkpoint_bytes)} with --keep-checkpoints {keep}, and its logs){stuck}: "
                         f"free some, lower --keep-checkpoints or choose another --logdir")


# --- one writer per run directory ---

def _read_lock_record(descriptor: int) -> dict:
    """What a RunLock's file says about its holder: {} when it says nothing
    (released, or the holder has not written it yet)."""
    try:
        text = os.pread(descriptor, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return {}
    if not text:
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"text": text[:200]}


def _describe_holder(record: dict) -> str:
    if "pid" in record:
        return f"pid {record['pid']} on host {record.get('host', '?')}, started {record.get('started', '?')}"
    return record.get("text", "a process that has not written its pid yet")


class RunLock:
    """The run directory's lock, run.lock: an exclusive POSIX lock
    (fcntl.lockf) that the primary process takes in RunDirectory.open and
    holds until the run ends, so that a second run in the same directory (a
    requeued job whose old allocation still runs, a reused --run-name) is
    refused instead of mixing its rows and checkpoints with the first's.
    The kernel drops the lock when its process ends, on kill -9 too: a lock
    that can be taken is stale, and its file only tells who held it. POSIX
    locks rather than flock: forked data-loading workers do not inherit them
    (a killed run's lock is free at once, not when its workers notice), and
    NFS implements flock with them anyway. Their one trap: closing any
    descriptor of the file drops the process's lock, so nothing else here
    opens run.lock. The file is never removed while in use (removing it would
    let a second run lock a new file of that name)."""

    def __init__(self, path: Path, descriptor: Optional[int], created: bool = False):
        self.path = path
        self._descriptor = descriptor  # None: the file system cannot lock
        self.created = created  # this run made the file: a start that fails removes it, locked or not

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    @staticmethod
    def take(run_dir: Path, flag: str) -> "RunLock":
        """Lock `run_dir` for this process, recording host, pid and start
        time; a UsageError naming the holder (and `flag`) when another
        process has it. A stale lock is taken over, with a warning; on a file
        system without locks, a warning, and the run goes on unlocked."""
        path = Path(run_dir) / LOCK_NAME
        created = not path.exists()
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise UsageError(f"argument {flag}: cannot create {path} ({error.strerror})") from None
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_lock_record(descriptor)
            os.close(descriptor)
            if error.errno in (errno.EACCES, errno.EAGAIN):
                raise UsageError(f"argument {flag}: {run_dir} is in use by another run, {_describe_holder(holder)} "
                                 f"({path}); wait for it to end or stop it, or choose another {flag}") from None
            print(f"warning: cannot lock {path} ({error.strerror}): this file system has no locks, so a second "
                  f"run started in {run_dir} would not be refused", file=sys.stderr, flush=True)
            return RunLock(path, None, created)
        previous = _read_lock_record(descriptor)
        mine = {"host": socket.gethostname(), "pid": os.getpid(),
                "started": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(mine) + "\n").encode(), 0)
        except OSError as error:  # a full disk: a file needs no room, its first bytes do
            with contextlib.suppress(OSError):
                path.unlink()  # ours to remove: we hold its lock
            os.close(descriptor)
            raise UsageError(f"argument {flag}: cannot write {path} ({error.strerror})") from None
        if previous and (previous.get("host"), previous.get("pid")) != (mine["host"], mine["pid"]):
            print(f"warning: {run_dir} was still locked by {_describe_holder(previous)}, which is gone (killed, "
                  f"or its node failed): taking the lock over", file=sys.stderr, flush=True)
        return RunLock(path, descriptor, created)

    def release(self, remove: bool = False) -> None:
        """Give the directory back before the process ends: the record is
        emptied (so the next run finds a released lock, not a stale one to
        warn about), or the file removed (`remove`: with the new directory it
        was made in, which a failed start removes again)."""
        if self._descriptor is None:  # no lock to drop; a file this failed start made goes with its directory
            if remove and self.created:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            return
        with contextlib.suppress(OSError):
            if remove:
                self.path.unlink()
            else:
                os.ftruncate(self._descriptor, 0)
        os.close(self._descriptor)  # drops the lock
        self._descriptor = None


def _remove_leftover_temporaries(run_dir: Path, may_remove: bool) -> List[Tuple[Path, int]]:
    """Remove the temporary files that saves killed mid-write left behind
    (kill -9, a node crash: one checkpoint's size each, some 200 MB for
    ResNet-50), when this process holds the run directory's lock
    (`may_remove`): then no other process writes here, so none is in use.
    Says what it removed; returns those that stay, with their sizes."""
    found = []
    with os.scandir(run_dir) as entries:
        for entry in entries:
            if TEMPORARY_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                found.append((Path(entry.path), entry.stat(follow_symlinks=False).st_size))
    removed_bytes, stuck = [], []
    for path, size in found:
        try:
            if may_remove:
                path.unlink()
                removed_bytes.append(size)
                continue
        except OSError:  # not ours to remove (another user's file), say
            pass
        stuck.append((path, size))
    if removed_bytes:
        print(f"note: removed {_temporary_files(len(removed_bytes))} of interrupted saves from {run_dir} "
              f"({format_bytes(sum(removed_bytes))})", file=sys.stderr, flush=True)
    return stuck


def _temporary_files(count: int) -> str:
    return f"{count} temporary file" + ("s" if count != 1 else "")


def _directory_flag(run_name: Optional[str], resume: Optional[str]) -> str:
    """The flag that chose the run directory, for messages about it."""
    return "--run-name" if run_name is not None else "--resume" if resume else "--logdir"


def _preserve(source: Path, destination: Path) -> None:
    """Keep `source`'s current content at `destination`: a hard link where the
    file system allows (files here are replaced by rename, never rewritten in
    place, so the link keeps the old content), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


class RunDirectory:
    """The run directory of this run, on the primary process: its path, and
    whether this run continues one that exists (a resume)."""

    def __init__(self, path: Path, resuming: bool, lock: Optional[RunLock] = None, made_from: Optional[Path] = None):
        self.path = Path(path)
        self.resuming = resuming
        self.lock = lock
        self.made_from = made_from  # the outermost folder this run created on the way (--logdir's), if any

    @staticmethod
    def open(cfg: Config, ctx: Context, checkpoint_bytes: Optional[int] = None) -> Optional["RunDirectory"]:
        """Create (or, on --resume, reopen) the run directory and lock it for
        this run (RunLock), after checking it is writable; remove what killed
        saves left there, then check it has room for `checkpoint_bytes`-sized
        checkpoints. The directory on the primary, None on the others. A
        collective: the primary's failure (say, --run-name taken, or in use
        by another run) is raised on every process, so none is left waiting
        for the others. A new run's directory is removed again when it fails."""
        failure = run_dir = None
        if ctx.is_primary:
            try:
                made_from = _outermost_missing(Path(cfg.logdir))
                path, resuming = _choose_directory(cfg, ctx)
                flag, lock = _directory_flag(cfg.run_name, cfg.resume), None
                try:
                    _check_writable(path)
                    lock = RunLock.take(path, flag)
                    stuck = _remove_leftover_temporaries(path, may_remove=lock.held)
                    _check_room(path, resuming, cfg.keep_checkpoints, checkpoint_bytes, stuck)
                except (UsageError, OSError) as error:
                    if lock is not None:
                        lock.release(remove=not resuming)
                    if not resuming:
                        _remove_empty_folders(path, made_from)
                    if isinstance(error, OSError):  # listing it, or its free space, failed
                        raise UsageError(f"argument {flag}: cannot use {path} "
                                         f"({error.strerror or error_summary(error)})") from None
                    raise
                run_dir = RunDirectory(path, resuming, lock, made_from)
            except UsageError as error:
                failure = str(error)
        failure = broadcast_from_primary(failure, ctx)
        if failure is not None:
            raise UsageError(failure)
        return run_dir

    def close(self, started: bool = True) -> None:
        """The run is over: release the directory (RunLock.release). A run
        that failed before it `started` (before config.json: say, its --resume
        checkpoint did not fit) removes the new directory it made, if still empty."""
        abandoned = not started and not self.resuming
        if self.lock is not None:
            self.lock.release(remove=abandoned)
        if abandoned:
            _remove_empty_folders(self.path, self.made_from)

    def set_aside_after(self, start_epoch: int, images_done: int, resumed_from: Optional[str]) -> Optional[str]:
        """Resuming from an earlier position than the run directory reached
        (say, from model_best.pth.tar, or from the previous checkpoint when the
        newest is damaged): what comes after it runs again. Its metrics rows
        and the newer checkpoints are kept in before-resume-<time>/ first
        (the newer checkpoint files are moved there, so that rotation, which
        keeps the newest, cannot prefer them to this run's), then metrics.csv
        keeps the earlier rows. Rows a crash cut short (files.read_whole_rows)
        are set aside too: an epoch number cut from 12 to 1 would otherwise
        be kept as epoch 1. Returns what was done, to be said; None when
        nothing comes after the position."""
        path = self.path / "metrics.csv"
        read = read_whole_rows(path, lambda row: (row.get("epoch") or "").isdigit()) if path.is_file() else None
        rows, columns = (read.rows, read.columns) if read is not None else ([], [])
        cut = f", {len(read.cut_lines)} not whole (cut short by a crash)" if read is not None and read.cut_lines else ""
        kept = [row for row in rows if int(row["epoch"]) < start_epoch]
        later_checkpoints = [checkpoint for checkpoint in kept_checkpoints(self.path)
                             if position_of(checkpoint) > (start_epoch, images_done)]
        if len(kept) == len(rows) and not later_checkpoints and not cut:
            return None
        stamp = f"before-resume-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        backup, attempt = self.path / stamp, 1
        while backup.exists():  # two resumes within a second keep both backups
            attempt += 1
            backup = self.path / f"{stamp}-{attempt}"
        backup.mkdir()
        for name in _RESULT_FILES:
            if (self.path / name).is_file():
                _preserve(self.path / name, backup / name)
        newest = self.path / CHECKPOINT_NAME
        if later_checkpoints and newest.is_file() and not (resumed_from and os.path.samefile(newest, resumed_from)):
            newest.unlink()  # a later state (kept in the backup): the next save makes it anew
        for checkpoint in later_checkpoints:
            os.replace(checkpoint, backup / checkpoint.name)
        if len(kept) != len(rows) or cut:
            rewrite_rows(path, columns, kept)  # the preserved copy keeps the later rows
        return (f"before {len(rows) - len(kept)} later metrics rows{cut} and {len(later_checkpoints)} later "
                f"checkpoints of {self.path.name}: they are kept in {backup}")

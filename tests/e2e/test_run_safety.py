"""One run per run directory (its lock), what killed saves leave behind, damaged
checkpoints, and how refused checkpoint files are described (issue 21, items 4, 6, 7, 10)."""
import json
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from common import checkpoint, rundir
from common.cli import parse
from common.distributed import single_process
from common.errors import UsageError
from helpers import FAST_ARGS, REPO, RunsCode, run_script

# A process that holds a run directory's lock through the function the scripts use, until killed.
HOLDER = """
import sys, time
from pathlib import Path
from common.rundir import RunLock
RunLock.take(Path(sys.argv[1]), "--run-name")
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """Start a process holding the lock of a run directory; yields a function
    (run_dir -> process) and kills what it started at the end."""
    started = []

    def start(run_dir: Path) -> subprocess.Popen:
        run_dir.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                                   text=True)
        started.append(process)
        assert process.stdout.readline().strip() == "locked"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def _open(logdir: Path, name: str = "X", checkpoint_bytes=None) -> rundir.RunDirectory:
    cfg = parse("nd", ["--synthetic", "--resume", "auto", "--run-name", name, "--logdir", str(logdir)])
    return rundir.RunDirectory.open(cfg, single_process("cpu"), checkpoint_bytes)


def test_a_lock_that_cannot_be_written_is_one_line_and_leaves_no_directory(tmp_path, monkeypatch):
    """A full disk still creates run.lock (an inode) but not its record: one line naming the file,
    as the free-space check would have said, and the new run directory removed again."""
    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir.os, "pwrite", disk_full)
    with pytest.raises(UsageError, match=r"^argument --run-name: cannot write .*/X/run\.lock \(No space left on "
                                         r"device\)$"):
        _open(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(rundir.shutil, "disk_usage", disk_full)  # and what is checked after the lock is taken
    with pytest.raises(UsageError, match=r"^argument --run-name: cannot use .*/X \(No space left on device\)$"):
        _open(tmp_path, checkpoint_bytes=10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("file_system_locks", [True, False])
def test_a_start_that_fails_before_config_json_leaves_nothing_it_made(tmp_path, monkeypatch, file_system_locks):
    """The run directory is opened and locked before --resume reads from it (common/session.py): a start
    that then fails (a refused checkpoint) removes the directory, its run.lock and the --logdir folders it
    made, whether or not the file system can lock; a resumed directory and anything already there stay."""
    if not file_system_locks:  # NFS without a lock daemon: lockf fails, the run goes on unlocked
        def no_locks(*args):
            raise OSError(37, "No locks available")

        monkeypatch.setattr(rundir.fcntl, "lockf", no_locks)
    logdir = tmp_path / "made" / "runs"
    opened = _open(logdir)
    assert (opened.path / "run.lock").is_file()
    opened.close(started=False)
    assert list(tmp_path.iterdir()) == []  # made/runs/X, its run.lock, runs/ and made/: all gone
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("the user's")
    opened = _open(tmp_path / "kept")
    opened.close(started=False)
    assert sorted(path.name for path in (tmp_path / "kept").iterdir()) == ["notes.txt"]


# --- item 4: two runs in one run directory ---

@pytest.mark.slow
def test_a_second_run_in_a_locked_directory_is_refused_in_one_line_naming_the_holder(tmp_path, holder):
    run_dir = tmp_path / "runs" / "X"
    first = holder(run_dir)
    result = run_script(["imagenet_nd.py", "--synthetic", *FAST_ARGS, "-j", "0", "--epochs", "1",
                         "--steps-per-epoch", "2", "--logdir", tmp_path / "runs", "--run-name", "X",
                         "--resume", "auto"])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"imagenet_nd.py: error: argument --run-name: {run_dir} is in use by another run, "
                               f"pid {first.pid} on host {socket.gethostname()}, started "), lines[0]
    # Nothing of the second run is written, and the holder's record stays.
    assert sorted(path.name for path in run_dir.iterdir()) == [rundir.LOCK_NAME]
    assert json.loads((run_dir / rundir.LOCK_NAME).read_text())["pid"] == first.pid


def test_a_stale_lock_is_taken_over_and_said_and_a_released_one_silently(tmp_path, holder, capfd):
    run_dir = tmp_path / "runs" / "X"
    gone = holder(run_dir)
    with pytest.raises(UsageError, match=f"is in use by another run, pid {gone.pid} on host "):
        _open(tmp_path / "runs")
    gone.send_signal(signal.SIGKILL)  # no chance to release: the kernel drops its lock
    gone.wait()
    capfd.readouterr()
    opened = _open(tmp_path / "runs")
    said = capfd.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"warning: {run_dir} was still locked by pid {gone.pid} on host "
                                                 f"{socket.gethostname()}"), said
    assert said[0].endswith("which is gone (killed, or its node failed): taking the lock over")
    # Read by another process: closing a descriptor of run.lock here would drop this process's lock.
    record = subprocess.check_output([sys.executable, "-c", "import sys; print(open(sys.argv[1]).read())",
                                      str(run_dir / rundir.LOCK_NAME)], text=True)
    assert json.loads(record)["pid"] == os.getpid()
    opened.close()  # a run that ends releases it: the next start has nothing to say
    assert (run_dir / rundir.LOCK_NAME).read_text() == ""
    _open(tmp_path / "runs").close()
    assert capfd.readouterr().err == ""


# --- item 7: what killed saves leave behind ---

def test_temporaries_of_killed_saves_are_removed_once_the_directory_is_locked(tmp_path, capfd):
    run_dir = tmp_path / "runs" / "X"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    leftovers = {".checkpoint-epoch000-images00000008.pth.tar.tmp-4194300": 3_000_000,  # atomic_write's
                 ".checkpoint.pth.tar.tmp-4194301": 1_500_000,  # a link's copy (files.link_atomically)
                 ".metrics.csv.tmp": 500}  # rewrite_rows'
    others = {".keep": 10, "notes.tmp": 10, "checkpoint-epoch000-images00000004.pth.tar": 10}
    for name, size in {**leftovers, **others}.items():
        (run_dir / name).write_bytes(b"x" * size)
    capfd.readouterr()
    _open(tmp_path / "runs").close()
    assert capfd.readouterr().err.splitlines() == [
        f"note: removed 3 temporary files of interrupted saves from {run_dir} (4.5 MB)"]
    assert sorted(path.name for path in run_dir.iterdir()) == sorted([*others, "config.json", rundir.LOCK_NAME])


def test_temporaries_that_cannot_be_removed_are_named_when_room_is_short(tmp_path, monkeypatch, capfd):
    run_dir = tmp_path / "runs" / "X"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    stuck = run_dir / ".checkpoint-epoch001-images00000000.pth.tar.tmp-4194302"
    stuck.write_bytes(b"x" * 2_000_000)
    real_unlink = Path.unlink

    def unlink(path, *args, **kwargs):
        if path == stuck:
            raise PermissionError(13, "Permission denied")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(UsageError) as refused:
        _open(tmp_path / "runs", checkpoint_bytes=10**6)
    assert (f"; 1 temporary file of interrupted saves there hold 2.0 MB and could not be removed (such as "
            f"{stuck}): free some") in str(refused.value)
    assert stuck.is_file() and (run_dir / "config.json").is_file()
    assert "removed" not in capfd.readouterr().err


# --- item 6: damaged checkpoints ---

def _flip_byte(path: Path, record: str, offset: int = 100) -> None:
    """Invert one bit `offset` bytes into `record` of a torch.save zip archive,
    where no zip header notices it: inside a tensor's bytes, or the pickle."""
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(record))
    with open(path, "r+b") as handle:
        handle.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
        handle.seek(info.header_offset + 30 + name_length + extra_length + offset)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("record, offset", [("/data/0", 100), ("/data.pkl", 40)])
def test_resume_auto_passes_over_a_checkpoint_with_flipped_bytes_with_a_warning(tmp_path, record, offset):
    for images in (8, 16, 24):
        checkpoint.save({"state_dict": {"w": torch.full((64,), float(images))}, "epoch": 0, "images_done": images},
                        tmp_path, is_best=False)
    newest = tmp_path / "checkpoint-epoch000-images00000024.pth.tar"
    _flip_byte(newest, record, offset)
    path, warnings_said = checkpoint.newest_readable(tmp_path)
    assert path == tmp_path / "checkpoint-epoch000-images00000016.pth.tar"
    assert warnings_said == [f"{newest} ({tmp_path / rundir.CHECKPOINT_NAME}) is not a readable checkpoint "
                             f"(damaged: the bytes of {record[1:]} fail their CRC-32 check)"]
    with pytest.raises(UsageError, match=re.escape(f"argument --resume: {newest} is not a readable checkpoint "
                                                   f"(damaged: the bytes of ")):
        checkpoint.load(str(newest))


@pytest.mark.slow
def test_resume_from_a_named_checkpoint_with_flipped_bytes_is_one_line_and_exit_2(tmp_path):
    damaged = tmp_path / "damaged.pth.tar"
    checkpoint.save({"state_dict": {"w": torch.ones(64)}, "epoch": 1}, tmp_path, is_best=False)
    shutil.copy(tmp_path / rundir.CHECKPOINT_NAME, damaged)
    _flip_byte(damaged, "/data/0")
    before = damaged.read_bytes()
    result = run_script(["imagenet_nd.py", "--synthetic", *FAST_ARGS, "-j", "0", "--resume", damaged, "--logdir",
                         tmp_path / "runs"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"imagenet_nd.py: error: argument --resume: {damaged} is not a readable checkpoint (damaged: the bytes of "
        f"data/0 fail their CRC-32 check)"]
    assert damaged.read_bytes() == before and not (tmp_path / "runs").exists()


# --- item 10: what a refused file is called ---

def _refusal(path: Path) -> str:
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(UsageError) as refused:
            checkpoint.load(str(path))
    assert [str(warning.message) for warning in warned] == []  # torch's notes on pickle protocols stay inside
    message = str(refused.value)
    assert "weights_only" not in message and "trusted source" not in message
    return message.removeprefix(f"argument --resume: {path} ")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_checkpoint_holding_code_is_said_to_and_refused(tmp_path, legacy):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth.tar"
    torch.save({"state_dict": {}, "payload": RunsCode(str(marker))}, path, _use_new_zipfile_serialization=not legacy)
    assert _refusal(path) == "holds code (posix.mknod, which loading it would call); refused"
    assert not marker.exists()


def test_files_torch_save_did_not_write_are_not_pytorch_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"arch": "resnet18"}))
    assert _refusal(tmp_path / "config.json") == ("is not a PyTorch checkpoint (text, not the zip archive "
                                                  "torch.save writes)")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"state_dict": {}}, protocol=4))
    assert _refusal(tmp_path / "raw.pkl") == ("is not a PyTorch checkpoint (a plain pickle, not the zip archive "
                                              "torch.save writes)")
    with zipfile.ZipFile(tmp_path / "images.zip", "w") as archive:
        archive.writestr("a.txt", "not a checkpoint")
    assert _refusal(tmp_path / "images.zip") == ("is not a PyTorch checkpoint (a zip archive without the data.pkl "
                                                 "torch.save writes)")


def test_a_truncated_checkpoint_is_described_in_whole_words(tmp_path):
    path = tmp_path / "cut.pth.tar"
    torch.save({"state_dict": {"w": torch.ones(1000)}}, path)
    path.write_bytes(path.read_bytes()[:3000])
    assert _refusal(path) == "is not a readable checkpoint (damaged: cut short, its zip directory is missing)"
    path.write_bytes(b"")
    assert _refusal(path) == "is not a readable checkpoint (damaged: the file is empty)"

"""common/data_timeout.py: a batch that does not come within --data-timeout
names the data-loading worker it was due from, its state and the file it is
reading; with --workers 0 a thread says it of the training process itself.

No test waits for a deadline that a slow machine could miss: every stall
here lasts until the test ends it (a stopped process, a FIFO nobody writes
to, an event only the timeout's own report sets), so the timeouts can be
short without a healthy batch ever meeting them."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from common import data_timeout
from common.data import ImageFolderDataset
from common.data_timeout import DataTimeout, batches
from common.errors import DATA_TIMEOUT_EXIT_STATUS, exit_status

TIMEOUT_SECONDS = 1.0


class _OnePixel:
    """A pipeline (data.ImageFolderDataset's: from_bytes, given the bytes the dataset read): a 1-pixel
    image; `before(name)`, when given, runs first."""

    def __init__(self, before=None):
        self.before = before

    def from_bytes(self, encoded: bytes, name: str):
        if self.before is not None:
            self.before(name)
        return torch.zeros(3, 1, 1, dtype=torch.uint8), len(encoded), 0


_read_whole = _OnePixel()


def _files(folder: Path, count: int) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        (folder / f"{index}.JPEG").write_bytes(b"x" * (index + 1))
    return [(str(folder / f"{index}.JPEG"), 0) for index in range(count)]


@pytest.fixture
def quick_worker_shutdown(monkeypatch):
    """torch gives each data-loading worker MP_STATUS_CHECK_INTERVAL (5 s) to exit when a loader stops;
    a stuck one takes all of it. Shorter here: what happens next is the same."""
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)


def _loader(dataset, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=1, num_workers=workers, timeout=TIMEOUT_SECONDS if workers else 0,
                      collate_fn=default_collate)


def test_a_worker_stuck_in_a_read_is_named_with_the_file_and_the_run_ends_with_status_5(tmp_path,
                                                                                        quick_worker_shutdown):
    samples = _files(tmp_path / "data", 3)
    stuck = tmp_path / "data" / "stuck.JPEG"  # a FIFO nobody writes to: open() waits, as on a hung file system
    stuck.unlink(missing_ok=True)
    os.mkfifo(stuck)
    dataset = ImageFolderDataset(samples[:2] + [(str(stuck), 0)] + samples[2:], _read_whole, workers=1)
    got = []
    with pytest.raises(DataTimeout) as raised:
        for batch in batches(_loader(dataset, 1), TIMEOUT_SECONDS, "training"):
            got.append(int(batch.file_bytes))
    assert got == [1, 2]  # the two files before the FIFO, then nothing
    line = str(raised.value)
    match = re.fullmatch(r"no training batch within --data-timeout 1 s: data-loading worker 0 \(pid (\d+)\) has been "
                         r"reading (.+) for (\d+) s", line)
    assert match and match.group(2) == str(stuck) and int(match.group(3)) >= TIMEOUT_SECONDS, line
    assert exit_status(raised.value) == DATA_TIMEOUT_EXIT_STATUS == 5


def test_a_stopped_worker_is_named_continued_and_the_batch_it_held_does_not_hang_the_trainer(tmp_path,
                                                                                              quick_worker_shutdown):
    """A worker stopped after it sent a batch holds the trainer inside torch's receive of that batch's
    tensors (their file descriptors come from the worker's own thread), where the DataLoader's timeout
    does not reach: the watch names it, continues it, and the batch that then comes is too late."""
    dataset = ImageFolderDataset(_files(tmp_path / "data", 8), _read_whole, workers=1)
    iterator = batches(_loader(dataset, 1), TIMEOUT_SECONDS, "validation")
    next(iterator)
    worker = int(dataset.reading.table[0, 0])  # its pid, as it noted with the file it read
    assert worker > 0 and worker != os.getpid()
    os.kill(worker, signal.SIGSTOP)  # between two files or in one: which, the line says
    try:
        with pytest.raises(DataTimeout) as raised:
            for _ in iterator:
                pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    line = str(raised.value)
    assert line.startswith(f"no validation batch within --data-timeout 1 s: data-loading worker 0 (pid {worker}; "
                           f"stopped by a signal, SIGSTOP or SIGTSTP?) "), line
    assert re.search(r"\) (has been reading \S+/\d\.JPEG for \d+ s|has read no file since \S+/\d\.JPEG, \d+ s ago)$",
                     line), line


def test_without_workers_a_thread_names_the_file_the_training_process_is_stuck_in(tmp_path):
    samples = _files(tmp_path / "data", 3)
    released = threading.Event()
    said = []

    def before(path: str):
        if path == samples[1][0]:
            assert released.wait(timeout=600), "the watch never fired"

    def expire(line: str) -> None:  # the stand-in for saying it and ending the process
        said.append(line)
        released.set()

    dataset = ImageFolderDataset(samples, _OnePixel(before), workers=0)
    got = []
    with pytest.raises(DataTimeout) as raised:  # the read came back, too late: the run stops all the same
        for batch in batches(_loader(dataset, 0), TIMEOUT_SECONDS, "training", expire=expire):
            got.append(int(batch.file_bytes))
    assert got == [1] and said == [str(raised.value)], said
    match = re.fullmatch(r"no training batch within --data-timeout 1 s: the training process itself \(--workers 0\) "
                         r"has been reading (.+) for (\d+) s; the read holds it, so it ends without a checkpoint "
                         r"\(--resume continues from the newest; with --workers 1 or more, a stall stops at a "
                         r"checkpoint\)", said[0])
    assert match and match.group(1) == samples[1][0] and int(match.group(2)) >= TIMEOUT_SECONDS, said[0]
    assert [thread.name for thread in threading.enumerate() if thread.name == "data-timeout watch"] == []


def test_a_timeout_of_0_waits_for_ever_and_adds_no_thread(tmp_path):
    dataset = ImageFolderDataset(_files(tmp_path / "data", 2), _read_whole, workers=0)
    threads = threading.active_count()
    iterator = batches(_loader(dataset, 0), 0, "training")
    assert int(next(iterator).file_bytes) == 1 and threading.active_count() == threads
    assert [int(batch.file_bytes) for batch in iterator] == [2]


def test_reading_slots_say_what_a_row_is_reading_and_which_has_read_longest(tmp_path):
    samples = [("/data/a.JPEG", 0), ("/data/b.JPEG", 0)]
    slots = data_timeout.ReadingSlots(workers=2)
    assert slots.describe(0, samples) == "has read no file yet" and slots.longest_reading() is None
    slots.started(1)  # in this process: the last row, the training process's own
    assert re.fullmatch(r"has been reading /data/b\.JPEG for \d+ s", slots.describe(-1, samples))
    assert slots.longest_reading() == 2
    slots.finished()
    assert re.fullmatch(r"has read no file since /data/b\.JPEG, \d+ s ago", slots.describe(-1, samples))
    assert slots.longest_reading() is None


@pytest.mark.parametrize("value", ["-1", "604801", "1e300", "nan"])
def test_a_timeout_out_of_range_is_one_line_naming_the_flag(value):
    from common import cli
    from common.errors import UsageError

    with pytest.raises(UsageError) as raised:
        cli.parse("nd", ["--synthetic", "--data-timeout", value])
    assert str(raised.value) == f"argument --data-timeout: expected seconds from 0 to 604800 (a week), got {value} " \
                                "(see --help)"
    assert cli.parse("nd", ["--synthetic", "--data-timeout", "604800"]).data_timeout == 604800.0
    assert cli.parse("nd", ["--synthetic"]).data_timeout == 600.0

"""--data-timeout: a batch that does not come says who holds it up.

A data-loading worker that stops (SIGSTOP, a debugger) or waits on a file
system that stopped answering would leave its training process waiting for
the batch forever, without a word. Each worker notes in a slot of shared
memory which file it is reading and since when (ReadingSlots, kept by
data.ImageFolderDataset); `batches` hands a loader's batches over and, when
one has not come within --data-timeout seconds, raises DataTimeout, whose
one line names the worker the batch was due from, its state (stopped,
waiting in the kernel) and the file it is reading. The training loop writes
a checkpoint first where it can (common.engine).

Two things can hold the training process up: a worker that does not deliver
(torch's DataLoader timeout raises), and one stopped after it delivered: the
batch's tensors come as file descriptors that the worker's own thread hands
over, so the training process (or its pin-memory thread) waits inside
torch's receive, where no timeout reaches. A thread watches every wait
(BatchWatch); at the timeout it notes who holds it up, continues stopped
workers (SIGCONT: the hand-over then completes, and the run stops at a
checkpoint all the same) and, if the training process is still held, says
so and ends it. With --workers 0 the training process reads the files
itself, and a read that never returns cannot be interrupted there: the
watch says what it reads and ends it, without a checkpoint.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, get_worker_info

from common.errors import DATA_TIMEOUT_EXIT_STATUS, ReportedError, report
from common.process_signals import is_stopped, stuck_state

# How torch's RuntimeError for a batch that did not come within the DataLoader's timeout starts.
_TORCH_TIMED_OUT = "DataLoader timed out"


class DataTimeout(ReportedError):
    """No batch came within --data-timeout; the line names the data-loading
    worker and the file it is reading, where known."""

    status = DATA_TIMEOUT_EXIT_STATUS


class ReadingSlots:
    """Which file each data-loading worker is reading, and since when: a row
    per worker and a last one for the training process itself (--workers 0),
    each (pid, dataset index, started, finished) in seconds of the
    system-wide monotonic clock, in shared memory, so that the training
    process reads what its forked workers write (a spawned one gets the
    same memory). A read costs two small writes to its row."""

    def __init__(self, workers: int):
        self.table = torch.full((workers + 1, 4), -1.0, dtype=torch.float64).share_memory_()
        self._rows = None  # a NumPy view of table, made in each process at its first use

    def __getstate__(self) -> dict:
        return {"table": self.table}

    def __setstate__(self, state: dict) -> None:
        self.table, self._rows = state["table"], None

    def _row(self):
        """This process's row: its worker id's, or the last one in the training process; None for a worker
        id beyond the rows (a loader given more workers than the slots were made for)."""
        if self._rows is None:
            self._rows = self.table.numpy()
        info = get_worker_info()
        row = info.id if info is not None else len(self._rows) - 1
        return self._rows[row] if info is None or row < len(self._rows) - 1 else None

    def started(self, index: int) -> None:
        row = self._row()
        if row is not None:
            row[:] = (os.getpid(), index, time.monotonic(), -1.0)

    def finished(self) -> None:
        row = self._row()
        if row is not None:
            row[3] = time.monotonic()

    def describe(self, row: int, samples) -> str:
        """What row `row` shows: the file being read and for how long, or the last one read."""
        _, index, started, finished = self.table[row].tolist()
        if index < 0:
            return "has read no file yet"
        path, now = samples[int(index)][0], time.monotonic()
        if finished < 0:
            return f"has been reading {path} for {now - started:.0f} s"
        return f"has read no file since {path}, {now - finished:.0f} s ago"

    def longest_reading(self) -> Optional[int]:
        """The row whose read has gone on longest (None when none is reading)."""
        reading = [(started, row) for row, (_, index, started, finished) in enumerate(self.table.tolist())
                   if index >= 0 and finished < 0]
        return min(reading)[1] if reading else None


# After the watch continued stopped workers, how long the training process may take to get free before
# the watch ends it.
UNBLOCK_GRACE_SECONDS = 30.0


def batches(loader: DataLoader, timeout_seconds: float, split: str, rank: Optional[int] = None,
            expire: Optional[Callable[[str], None]] = None) -> Iterator:
    """`loader`'s batches; one that has not come within `timeout_seconds`
    (0: wait for ever) raises DataTimeout, naming the worker it was due from
    and what that worker is reading. A loader with workers must have been
    made with that timeout (torch's DataLoader(timeout=...)). A training
    process the watch cannot free is told so and ended (`expire`, given the
    line: the tests' stand-in). `split`: "training" or "validation"."""
    if not timeout_seconds:
        yield from loader
        return
    iterator = iter(loader)
    expire = expire or functools.partial(_end_process, rank=rank)
    said = f"no {split} batch within --data-timeout {timeout_seconds:g} s: "
    if loader.num_workers:
        watch = BatchWatch(timeout_seconds, functools.partial(_held_up_by, said, iterator, loader.dataset), expire,
                           unblock=functools.partial(_continue_stopped, iterator))
    else:
        watch = BatchWatch(timeout_seconds, functools.partial(_training_process_reading, said, loader.dataset),
                           expire)
    try:
        while True:
            watch.arm()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as error:
                if not str(error).startswith(_TORCH_TIMED_OUT):
                    raise
                said = watch.disarm() or watch.describe()
                break
            said = watch.disarm()
            if said is not None:  # the watch freed it: the batch came, too late
                break
            yield batch
    finally:
        watch.close()
    # Stopped workers continued and the workers stopped now (torch gives each 5 s to exit), while peers still
    # wait in a collective: a trainer that left the group first would seem to them to hang.
    _continue_stopped(iterator)
    del watch, iterator
    raise DataTimeout(said)


def _awaited(iterator) -> Optional[int]:
    """The data-loading worker the awaited batch is due from (torch's
    iterator keeps which: its _task_info of the _rcvd_idx'th batch)."""
    task = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", None))
    return task[0] if task else None


def _held_up_by(said: str, iterator, dataset) -> str:
    """`said`, then the worker the awaited batch is due from (else the one
    reading a file longest), its pid and state, and what it is reading."""
    slots = getattr(dataset, "reading", None)
    worker = _awaited(iterator)
    if worker is None and slots is not None:
        worker = slots.longest_reading()
    workers = getattr(iterator, "_workers", [])
    if worker is None or worker >= len(workers):
        return f"{said}a data-loading worker did not deliver it"
    pid = workers[worker].pid
    state = stuck_state(pid)
    said += f"data-loading worker {worker} (pid {pid}{'; ' + state if state else ''})"
    return f"{said} {slots.describe(worker, dataset.samples)}" if slots is not None else f"{said} did not deliver it"


def _training_process_reading(said: str, dataset) -> str:
    slots = getattr(dataset, "reading", None)
    reading = slots.describe(-1, dataset.samples) if slots is not None else "did not make it"
    return (f"{said}the training process itself (--workers 0) {reading}; the read holds it, so it ends without a "
            f"checkpoint (--resume continues from the newest; with --workers 1 or more, a stall stops at a "
            f"checkpoint)")


def _continue_stopped(iterator) -> None:
    """SIGCONT to the iterator's stopped workers: they hand over what they
    hold, and exit when the iterator stops them (else torch waits on them:
    without end for its pin-memory thread)."""
    for worker in getattr(iterator, "_workers", []):
        if worker.pid and worker.pid > 0 and is_stopped(worker.pid):
            os.kill(worker.pid, signal.SIGCONT)


class BatchWatch:
    """A thread that acts when a wait for a batch (from arm() to disarm())
    outlasts `timeout_seconds`: it notes what holds it up (`describe()`),
    calls `unblock` if given and, if the wait still goes on
    UNBLOCK_GRACE_SECONDS later (at once without `unblock`), calls `expire`
    with that line. Per batch it costs two lock round trips."""

    def __init__(self, timeout_seconds: float, describe: Callable[[], str], expire: Callable[[str], None],
                 unblock: Optional[Callable[[], None]] = None):
        self.timeout_seconds = timeout_seconds
        self.describe, self._expire, self._unblock = describe, expire, unblock
        self._deadline: Optional[float] = None  # monotonic seconds; None: not waiting
        self._said: Optional[str] = None  # the line, once the watch acted
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="data-timeout watch")
        self._thread.start()

    def arm(self) -> None:
        with self._changed:
            self._deadline = time.monotonic() + self.timeout_seconds
            self._changed.notify()

    def disarm(self) -> Optional[str]:
        """The wait is over; the watch's line if it acted meanwhile, else None."""
        with self._changed:
            self._deadline = None
            self._changed.notify()
            return self._said

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._changed:
            while True:  # armed, then past the deadline; a disarm or a new arm starts the wait over
                if self._closed:
                    return
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    break
                self._changed.wait(None if self._deadline is None else self._deadline - time.monotonic())
            self._said = said = self.describe()
        if self._unblock is not None:
            self._unblock()
            grace_end = time.monotonic() + UNBLOCK_GRACE_SECONDS
            with self._changed:
                while not self._closed and self._deadline is not None and time.monotonic() < grace_end:
                    self._changed.wait(grace_end - time.monotonic())
                if self._closed or self._deadline is None:  # freed: batches() raises DataTimeout itself
                    return
        self._expire(said)


def _end_process(line: str, rank: Optional[int]) -> None:
    """Say `line` (as a DataTimeout) and end the process at once: its training thread is held where nothing
    reaches it."""
    report(DataTimeout(line), rank)
    sys.stdout.flush()
    os._exit(DATA_TIMEOUT_EXIT_STATUS)

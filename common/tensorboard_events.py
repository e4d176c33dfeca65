"""TensorBoard's event files for common.telemetry: a SummaryWriter whose
failure to write (a full disk) is a warning of the run's, not its end, and
an event file never left ending in part of a record. Moved out of
telemetry.py so the sinks and the writer's mechanics each stay readable;
tensorboard is imported only when a writer is made.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Optional


class FailSafeFile:
    """The event file under a TensorBoard writer, as its background thread
    writes it, a record per write: a write that fails (a full disk) is undone
    (the file cut back to its size before, so it never ends in part of a
    record, which readers take for damage), kept in `error`, and every later
    one dropped, instead of the thread dying with a traceback on stderr and
    every later add_scalar raising its error."""

    def __init__(self, file, path: Path):
        self.file, self.path, self.error = file, path, None

    def write(self, data) -> None:
        if self.error is not None:
            return
        size_before = self.path.stat().st_size
        try:
            self.file.write(data)
        except OSError as error:
            self.error = error
            with contextlib.suppress(OSError):
                os.truncate(self.path, size_before)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except OSError as error:
                self.error = error

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()

    @property
    def closed(self) -> bool:
        return self.file.closed


class EventWriter:
    """A TensorBoard SummaryWriter whose failure to write (a full disk) is not
    the run's: `on_failure` hears of the first one, the event file keeps its
    whole records, and later scalars are dropped (the writer's thread cannot
    go on after a failed write). Writes happen in that background thread, so
    a failure shows at the next add_scalar or flush."""

    def __init__(self, log_dir: Path, purge_step: Optional[int], on_failure: Callable[[str], None]):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

        self._on_failure = on_failure
        self._writer = self._file = None
        try:
            self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        except OSError as error:
            on_failure(error.strerror or str(error))
            return
        try:  # tensorboard's EventFileWriter (2.x): the file its thread writes, wrapped; see FailSafeFile
            events = self._writer.file_writer.event_writer
            records = events._async_writer._writer
            # Only tensorboard's own file (without TensorFlow installed) writes each record through to the
            # file, which FailSafeFile's cut-back needs; TensorFlow's buffers them.
            if type(records._writer).__module__.startswith("tensorboard.compat.tensorflow_stub"):
                self._file = records._writer = FailSafeFile(records._writer, Path(events._file_name))
        except AttributeError:  # another version: its failures come out of add_scalar and flush instead
            pass

    def add_scalar(self, tag: str, value: float, global_step: int, walltime: Optional[float] = None) -> None:
        self._call(self._writer.add_scalar if self._writer else None, tag, value, global_step=global_step,
                   walltime=walltime)

    def flush(self) -> None:
        self._call(self._writer.flush if self._writer else None)

    def close(self) -> None:
        if self._call(self._writer.close if self._writer else None):
            self._writer = None

    def _call(self, operation, *args, **kwargs) -> bool:
        """Whether `operation` (None: the writer failed before) succeeded."""
        if operation is None:
            return False
        try:
            operation(*args, **kwargs)
            error = self._file.error if self._file is not None else None
        except OSError as raised:
            error = raised
        if error is None:
            return True
        writer, self._writer = self._writer, None
        with contextlib.suppress(OSError):
            writer.close()  # stops its thread
        self._on_failure(error.strerror or str(error))
        return False

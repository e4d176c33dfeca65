"""Mistakes and endings: the error a user can fix, its one-line report, and
every exit status of the entry scripts by name.

The bottom of the package: it imports nothing of common/, so every module
can raise a UsageError and every process ends with a status from here.
"""
from __future__ import annotations

import gc
import os
import re
import sys
import time
from typing import Callable, Optional

# Exit statuses, one meaning each. A launcher (torchrun, srun, Slurm's requeue logic) and the
# per-node spawner read them, so they never change.
FAILED_EXIT_STATUS = 1  # a worker process failed (a bug, a crash, a signal): its traceback says why
USAGE_EXIT_STATUS = 2  # a mistake the user can fix (UsageError), reported in one line; argparse's status too
NONFINITE_EXIT_STATUS = 3  # the training loss became NaN or inf (loss_guard.LossGuard); those weights are not saved
PEER_LOST_EXIT_STATUS = 4  # a worker lost a peer: one that failed first (it says why), or stopped answering
# No batch came within --data-timeout: a data-loading worker (or, with --workers 0, the training process's own
# read) that stopped, a file system that stopped answering; one line names the worker and the file.
DATA_TIMEOUT_EXIT_STATUS = 5
# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": stopped on a signal after
# writing a checkpoint, not finished. Running the same command again (with --resume auto) continues.
STOPPED_EXIT_STATUS = 75
# sysexits.h EX_IOERR: a checkpoint the run cannot end without (its last, or a stop's) could not be written
# (a full disk); one line names the newest checkpoint on disk. Free some space, then --resume it.
WRITE_FAILED_EXIT_STATUS = 74
INTERRUPTED_EXIT_STATUS = 130  # Ctrl-C (128 + SIGINT), as shells report it


class ReportedError(Exception):
    """An ending that is no bug: one line (no traceback) from the process
    that meets it, and its exit status, `status` (see exit_status)."""

    status = FAILED_EXIT_STATUS
    # A rank-specific error (an unreadable image in one process's share of the data, a peer it cannot
    # reach, a batch that does not come) is reported by the process that meets it.
    rank_specific = True

    def __init__(self, message: str = ""):
        super().__init__(one_line(without_credentials(self.raised_in_worker(message))))

    @classmethod
    def raised_in_worker(cls, message: str) -> str:
        """The original one-line message of an error a data-loading worker
        raised: the DataLoader rebuilds it in the training process as
        type(error)("Caught ... Original Traceback ...\\n...Name: <message>");
        the user sees only <message>."""
        marker = f"{cls.__name__}: "
        if "Original Traceback" in message and marker in message:
            return message.rsplit(marker, 1)[1].strip()
        return message


# The user part of a URL (scheme://USER[:PASSWORD]@, a token among them), or a bare USER:PASSWORD@ where a
# word starts (a Ray address, a value argparse quotes): never printed, logged or saved.
# Up to the last @ of the word: a password may hold / or @ too.
_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"]*@"
                          r"|(?P<start>^|[\s'\"=(,])[^\s/@:'\"=(,]+:(?!/)[^\s'\"]*@")


def without_credentials(text: str) -> str:
    """`text` with every credential of a URL in it shown as ***:
    'tcp://alice:s3cret@node0:29500' -> 'tcp://***@node0:29500'. For every
    line that quotes what a user gave (a flag's value, the command line)."""
    return _CREDENTIALS.sub(lambda match: (match.group("scheme") or match.group("start")) + "***@", text)


class UsageError(ReportedError):
    """A mistake the user can fix (a flag, a path, a dataset): reported as one
    line naming the flag or path, with exit status 2 and no traceback."""

    status = USAGE_EXIT_STATUS
    # Under DDP every process checks the same flags and folders and meets the same error; only the
    # primary process reports those.
    rank_specific = False


# Control characters and line separators, as Python writes them in a string literal.
_ESCAPED_CONTROLS = {code: repr(chr(code))[1:-1] for code in (*range(32), 127, 0x85, 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """`text` as one line, whatever a quoted path or value in it holds (a
    newline in a file name): control characters are shown escaped (and
    undecodable bytes, as printable does)."""
    return printable(text).translate(_ESCAPED_CONTROLS)


def printable(text: str) -> str:
    """`text` with the bytes of a file name that is not valid UTF-8 (which
    Python hands over as lone surrogates) shown as \\xNN: printed as they
    are, they would raise UnicodeEncodeError on a UTF-8 terminal or log."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def error_summary(error: BaseException, line: int = 0, limit: int = 200) -> str:
    """One line of an exception's message (the first, or `line`), at most
    `limit` characters, for quoting inside a one-line UsageError; the
    exception's type name when it has no message."""
    lines = [text.strip() for text in str(error).splitlines() if text.strip()]
    return lines[line][:limit] if lines else type(error).__name__


def program() -> str:
    """The running script's name, as error lines start with it: `imagenet_nd.py`,
    or `python -m common.tools.plots` for a module run with -m."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("common."):
        return f"python -m {spec.name}"
    return os.path.basename(sys.argv[0])


def report(error: ReportedError, rank: Optional[int] = None, local_rank: Optional[int] = None) -> None:
    """Print `error` as one `prog: error: ...` line, once per node: by this
    process if it runs alone (rank None), if it is the first process of its
    node (local rank 0), or if it alone meets the error (error.rank_specific).
    The other processes of a node meet the same error and stay silent."""
    if rank is None or local_rank == 0 or error.rank_specific:
        where = f"rank {rank}: " if rank else ""
        print(f"{program()}: error: {where}{error}", file=sys.stderr, flush=True)
    else:
        # Local rank 0 meets the same error and reports it: give it a moment before this process's
        # exit makes a launcher stop the job.
        time.sleep(1.0)


def exit_status(error: BaseException, rank: Optional[int] = None, local_rank: Optional[int] = None,
                say_interrupted: bool = True) -> int:
    """The one mapping from an exception that ends a process to its exit
    status, used by cli.run and by the workers a script spawns: a
    ReportedError is reported (see report) and gives its status (a
    UsageError USAGE_EXIT_STATUS); Ctrl-C
    gives INTERRUPTED_EXIT_STATUS, said once by the process the user started
    (`say_interrupted`; Ctrl-C reaches every process of the terminal).
    Anything else is a bug, whose traceback is the report: re-raised."""
    if isinstance(error, ReportedError):
        report(error, rank, local_rank)
        return error.status
    if isinstance(error, KeyboardInterrupt):
        if say_interrupted:
            print(f"{program()}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_STATUS
    raise error


def run_main(main: Callable[[], object], rank: Optional[int] = None, local_rank: Optional[int] = None) -> None:
    """Run a command's main(): a ReportedError becomes one line on stderr
    and its exit status (a UsageError 2), Ctrl-C exit status 130, neither
    with a traceback (exit_status). `rank`, `local_rank`: this process's, when a launcher
    started it as one of several."""
    try:
        main()
    except (ReportedError, KeyboardInterrupt) as error:
        sys.exit(exit_status(error, rank, local_rank))
    finally:
        skip_final_collection()


def skip_final_collection() -> None:
    """Spare the interpreter's last garbage collection, at exit, over the
    objects of torch, torchvision and torch._dynamo: 1.3 s of every process's
    run on a 2-core VM (measured: `import common.engine` and exit, 6.9 s against
    5.7 s). What is left is freed with the process; files, checkpoints and
    TensorBoard writers are closed explicitly before this, and data-loading
    processes are stopped by multiprocessing's own exit handler."""
    gc.freeze()

"""What the processes of a job do with signals, and how they die with
their parent. Imports no torch, so the command line (common.cli) can use it.

A training process ignores stop signals until training handles them
(common.preemption.StopControl); a worker this script spawns, and every
data-loading worker, dies with its parent, so no process outlives the job;
data-loading workers leave stop signals to their trainer (Slurm signals
every process of a job step) and say nothing when it stops mid-transfer.
"""
from __future__ import annotations

import ctypes
import faulthandler
import functools
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, even
    by SIGKILL, so no worker is left holding a GPU, a port or memory."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
            os._exit(1)


def data_loader_worker_init(worker_id: int) -> None:
    """DataLoader worker_init_fn: data-loading processes die with their
    trainer, say nothing when it stops in the middle of a transfer, and
    leave stop signals to it: Slurm signals every process of a job step, and
    a data-loading worker that died of one would end the trainer with an
    error before it could write its checkpoint."""
    die_with_parent()
    sys.excepthook = _silent_when_the_trainer_is_gone
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # SIGTERM still has to end the worker when the trainer sends it (DataLoader and multiprocessing
    # stop workers that way), so it cannot simply be ignored: it is blocked, and a thread takes each
    # one and looks at its sender.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from_parent, daemon=True, name="sigterm-from-parent").start()


class _WorkerProcess(multiprocessing.context.ForkProcess):
    """A data-loading worker forked with SIGTERM blocked, after `before_fork` (see data_loader_context)."""

    def __init__(self, *args, before_fork: Optional[Callable[[], None]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._before_fork = before_fork

    def start(self) -> None:
        if self._before_fork is not None:
            self._before_fork()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _WorkerContext(multiprocessing.context.ForkContext):
    def __init__(self, before_fork: Optional[Callable[[], None]] = None):
        super().__init__()
        # DataLoader makes its workers with context.Process(target=..., args=...).
        self.Process = functools.partial(_WorkerProcess, before_fork=before_fork)


def data_loader_context(before_fork: Optional[Callable[[], None]] = None
                        ) -> Optional[multiprocessing.context.BaseContext]:
    """The multiprocessing context for DataLoader workers: fork, as on Linux
    by default, but with SIGTERM blocked from the child's first instruction.
    Threads that libraries start in the child before data_loader_worker_init
    runs (at fork, or in torch.set_num_threads(1): seen once a gloo group has
    joined) inherit that mask; started with SIGTERM open, any of them could
    take a SIGTERM from another process (slurmstepd signals every process of
    a job) and the worker would die of it. `before_fork` is called in the
    training process before each worker is forked: a child gets only the
    forking thread, and any lock another thread held at that instant stays
    held in it for good, so threads that need not live across the fork end
    there (--data-backend dali: DaliDecoder.end_threads). None (the default
    context) where fork is not what multiprocessing uses here."""
    method = multiprocessing.get_start_method(allow_none=True)  # None: not chosen yet (not fixed by asking)
    default = "forkserver" if sys.version_info >= (3, 14) else "fork"  # Linux's, since Python 3.14 forkserver
    if not sys.platform.startswith("linux") or (method or default) != "fork":
        return None  # forkserver, spawn: the worker starts without this process's threads
    return _WorkerContext(before_fork)


def _exit_on_sigterm_from_parent() -> None:
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)


# The states of /proc/<pid>/stat that explain a process that does not answer its peers or its trainer.
_STUCK_STATES = {"T": "stopped by a signal, SIGSTOP or SIGTSTP?", "t": "stopped by a debugger",
                 "D": "waiting in the kernel uninterruptibly, on a file system that stopped answering?",
                 "Z": "exited", "X": "exited"}


def stuck_state(pid: int) -> Optional[str]:
    """Why process `pid` may not answer, as Linux's /proc says: stopped,
    waiting uninterruptibly in the kernel, or gone; None while it runs or
    sleeps as usual (or where /proc cannot say)."""
    return _STUCK_STATES.get(_state(pid))


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (by a signal or a debugger)."""
    return _state(pid) in ("T", "t")


def _state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat; "X" (dead) for no such process, "" where /proc cannot say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"
    except (OSError, IndexError):
        return ""


def ignore_stop_signals_until_training() -> None:
    """SIGUSR1 and SIGUSR2 end a process by default: until training installs
    its handlers (common.preemption.StopControl), a preemption warning that
    arrives during start-up is ignored instead of killing the process."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)


def dump_stacks_on_quit() -> None:
    """SIGQUIT (Ctrl-\\ at a terminal) writes the stack of every Python thread of this process to stderr, and
    the process goes on, instead of ending with a core dump: what a hang looks like from inside. The
    spawner asks it of a worker its peers gave up on, and of that worker's data-loading workers, which
    inherit the handler when forked, before it kills them (common.spawn)."""
    # File descriptor 2, not sys.stderr: a stand-in for it (pytest's capture, a notebook) may have no descriptor.
    faulthandler.register(signal.SIGQUIT, file=2, all_threads=True, chain=False)


def children_of(pid: int) -> List[int]:
    """The processes whose parent is `pid`, as /proc says ([] where it cannot)."""
    children = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
    return children


def _silent_when_the_trainer_is_gone(kind, value, traceback) -> None:
    # Batches travel as file descriptors, sent by a multiprocessing thread that reports a trainer
    # closing the connection mid-send (Ctrl-C, a stopped job) through sys.excepthook: a traceback
    # after "interrupted" that means nothing. Data errors do not come here: the DataLoader sends
    # them to the trainer, which reports them.
    if not issubclass(kind, (ConnectionError, EOFError)):
        sys.__excepthook__(kind, value, traceback)

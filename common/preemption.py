"""Stopping cleanly: stop signals, the decision every process shares, periodic
checkpoints and the Slurm requeue.

A cluster ends jobs with a signal: Slurm sends `--signal` (USR1 here by
default) some minutes before the time limit, SIGTERM on preemption or
scancel; torchrun passes SIGTERM on to its workers. Any process may receive
it first, or alone. If each stopped on its own, the others would wait
forever in the next collective; so a signal only sets a flag, and before each
training step all processes combine their flags (a maximum over a small
tensor, on a gloo group of its own, one step behind so it never delays a
step). They see the same combined value and stop at the same step; the
primary writes a checkpoint there. The same shared decision times the
periodic checkpoints of --checkpoint-every, so a time-based one is taken
at one step on every process.

After the checkpoint, a stop on --preempt-signal under Slurm requeues the job
(`scontrol requeue`, once, by the primary), and the process exits with
STOPPED_EXIT_STATUS. The requeued job runs the same command; with
--resume auto it continues from that checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import Context, spans_processes
from common.errors import STOPPED_EXIT_STATUS
from common.launcher import slurm_job_id

# What a process's flag holds, combined by maximum: a requeueing stop outranks a plain one.
_NOTHING, _CHECKPOINT, _STOP, _STOP_AND_REQUEUE = range(4)
_SIGNAL_SPAN = 256  # signal numbers are below this


class TrainingStopped(SystemExit):
    """Raised after a clean stop (checkpoint written): the process exits with
    STOPPED_EXIT_STATUS, unwinding like any exit (process group left, files closed)."""

    def __init__(self, signal_name: str):
        super().__init__(STOPPED_EXIT_STATUS)
        self.signal_name = signal_name


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every process does before this step, the same on all of them."""

    checkpoint: bool = False
    stop: bool = False
    requeue: bool = False
    signal_name: Optional[str] = None  # a stop signal a process received (the preempt signal, if any did)


def _handles_signals() -> bool:
    """Whether this thread can install signal handlers: Python allows it only
    in the main thread, and Ray Train calls the training function in another.
    There a stop comes as Ray's own (a drained node, a killed worker), which
    the checkpoints and Ray's restarts (--max-failures) handle; the periodic
    checkpoints (--checkpoint-every) still work."""
    return threading.current_thread() is threading.main_thread()


class StopControl:
    """Signal flags, and the decision shared by all processes at each step.
    Use as a context manager around training: the handlers are installed
    on entry and the previous ones restored on exit."""

    def __init__(self, ctx: Context, preempt_signal: str = "SIGUSR1", checkpoint_every_steps: int = 0,
                 checkpoint_every_minutes: float = 0.0, requeue: str = "auto"):
        self.ctx = ctx
        self.requeue = requeue  # --requeue: auto | always | never
        self.preempt_signal = signal.Signals[preempt_signal]  # a name cli checked: SIGUSR1
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_seconds = 60.0 * checkpoint_every_minutes
        self.received: Optional[signal.Signals] = None
        self._previous_handlers: Dict[signal.Signals, object] = {}
        self._pending = None  # (work, tensor) of the combination started at the last step
        self._last_checkpoint = time.monotonic()

    @staticmethod
    def for_run(cfg: Config, ctx: Context) -> "StopControl":
        return StopControl(ctx, cfg.preempt_signal, cfg.checkpoint_every_steps, cfg.checkpoint_every_minutes,
                           cfg.requeue)

    # --- signals ---

    def __enter__(self) -> "StopControl":
        if not _handles_signals():
            return self
        for signum in {self.preempt_signal, signal.SIGTERM}:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        self._drain()

    def ignore_signals(self) -> None:
        """From a stop decision to the exit: the stop is under way, and more
        signals (Slurm's SIGTERM after `scontrol requeue`) must not cut it short."""
        if not _handles_signals():
            return
        for signum in {self.preempt_signal, signal.SIGTERM}:
            signal.signal(signum, signal.SIG_IGN)

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: the stop happens at the next step that every process agrees on.
        if self.received is None:
            self.received = signal.Signals(signum)

    def _local_flags(self, include_timer: bool = True) -> torch.Tensor:
        wish = _NOTHING
        if (include_timer and self.checkpoint_every_seconds and self.ctx.is_primary  # one clock decides: the primary's
                and time.monotonic() - self._last_checkpoint >= self.checkpoint_every_seconds):
            wish = _CHECKPOINT
            self._last_checkpoint = time.monotonic()  # wished once; the checkpoint follows a step later
        signal_value = 0
        if self.received is not None:
            wish = _STOP_AND_REQUEUE if self.received == self.preempt_signal else _STOP
            signal_value = int(self.received)
        # One number, so the maximum over processes keeps a wish together with a signal that caused it.
        return torch.tensor([wish * _SIGNAL_SPAN + signal_value], dtype=torch.int64)

    @staticmethod
    def _decision(flags: torch.Tensor) -> Decision:
        wish, signal_value = divmod(int(flags.item()), _SIGNAL_SPAN)
        name = signal.Signals(signal_value).name if signal_value else None
        return Decision(checkpoint=wish >= _CHECKPOINT, stop=wish >= _STOP, requeue=wish == _STOP_AND_REQUEUE,
                        signal_name=name)

    # --- the shared decision ---

    def _combined(self) -> bool:
        return spans_processes(self.ctx)

    def step(self, global_step: int) -> Decision:
        """Call before each training step, on every process, with the number
        of steps the run has completed. Returns the decision combined from
        every process's flags as of the previous call: the same on all."""
        flags = self._local_flags()
        if not self._combined():
            decision = self._decision(flags)
        else:
            decision = self._collect() or Decision()
            self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.control_group,
                                             async_op=True), flags)
        if self.checkpoint_every_steps and global_step > 0 and global_step % self.checkpoint_every_steps == 0:
            decision = dataclasses.replace(decision, checkpoint=True)  # every process counts the same steps
        return decision

    def now(self) -> Decision:
        """The decision from every process's flags as they are now (waits for
        all of them), for a stop only: between an epoch's training and its
        validation, and after its checkpoint (periodic checkpoints wait: one
        comes at the epoch's end anyway)."""
        self._drain()
        flags = self._local_flags(include_timer=False)
        if self._combined():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
        self._last_checkpoint = time.monotonic()
        return self._decision(flags)

    def barrier(self) -> None:
        """Wait for every process (bounded by --dist-timeout, as every collective)."""
        self._drain()
        if self._combined():
            dist.barrier(group=self.ctx.control_group)

    def _collect(self) -> Optional[Decision]:
        if self._pending is None:
            return None
        work, flags = self._pending
        self._pending = None
        work.wait()
        return self._decision(flags)

    def _drain(self) -> None:
        """Finish the combination in flight (every process has one, from the same step)."""
        if self._pending is not None and self._combined():
            self._pending[0].wait()
        self._pending = None


class NoStops:
    """StopControl's part for a Trainer used on its own (tests, a notebook):
    no signal handlers, no mid-epoch checkpoints, never a stop."""

    requeue = "never"

    def __enter__(self) -> "NoStops":
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def step(self, global_step: int) -> Decision:
        return Decision()

    def now(self) -> Decision:
        return Decision()

    def barrier(self) -> None:
        pass

    def ignore_signals(self) -> None:
        pass


def should_requeue(mode: str, environ: Mapping[str, str] = os.environ) -> bool:
    """--requeue auto: under Slurm (SLURM_JOB_ID set); always / never as said."""
    if mode == "auto":
        return slurm_job_id(environ) is not None
    return mode == "always"


def requeue_slurm_job(log, environ: Mapping[str, str] = os.environ) -> bool:
    """`scontrol requeue <job id>` (primary only, once per stop). Returns
    whether it was requeued; a failure is reported, not raised: the
    checkpoint is written, and the user can resubmit by hand."""
    job_id = slurm_job_id(environ)
    if job_id is None:
        log.info("--requeue always: SLURM_JOB_ID is not set, so there is no job to requeue; "
                 "run the same command again to continue")
        return False
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        log.info(f"could not requeue Slurm job {job_id}: scontrol is not on PATH; resubmit the job to continue")
        return False
    try:
        result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.info(f"could not requeue Slurm job {job_id} ({error}); resubmit the job to continue")
        return False
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()[:200]
        log.info(f"could not requeue Slurm job {job_id}: scontrol requeue {job_id} exited with status "
                 f"{result.returncode} ({output}); resubmit the job to continue")
        return False
    log.info(f"requeued Slurm job {job_id} (scontrol requeue {job_id}): it continues from the checkpoint when it "
             f"starts again")
    return True

"""fit(): the epochs of a run, each trained and validated (common/engine.py's
Trainer), its metrics logged and its checkpoint written; and how a run ends
other than at its last epoch: a stop signal (a checkpoint, then exit 75), a
non-finite loss (no checkpoint, exit 3), a checkpoint it cannot end without
that could not be written (exit 74). Every process takes the same way out at
the same step, so none is left waiting in a collective. A batch that does
not come within --data-timeout (exit 5) is met by one process: alone, it
stops at a checkpoint; with peers, it ends and they lose it (exit 4).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from common import measure, preemption
from common.checkpoint import Checkpointer, ResumePoint
from common.data import Loaders
from common.data_timeout import DataTimeout
from common.distributed import Context, broadcast_from_primary, spans_processes
from common.engine import StopRequested, Trainer, saved_or_why
from common.loss_guard import NonFiniteLoss
from common.errors import NONFINITE_EXIT_STATUS, WRITE_FAILED_EXIT_STATUS
from common.meters import ClassReport, EpochMetrics
from common.preemption import StopControl, TrainingStopped
from common.telemetry import RunLog


@dataclasses.dataclass(frozen=True)
class FitResult:
    epochs_run: int
    seconds: float  # wall time of this call, validation and checkpoints included
    best_acc1: float
    best_epoch: Optional[int]
    best_source: Optional[str] = None  # whose top-1 best_acc1 is: "model", or "ema" (--model-ema)


class CheckpointNotWritten(SystemExit):
    """Raised on every process when a checkpoint the run cannot end without
    (its last, or a stop's) could not be written: exit WRITE_FAILED_EXIT_STATUS."""

    def __init__(self):
        super().__init__(WRITE_FAILED_EXIT_STATUS)


class _LastCheckpointFailed(Exception):
    """Unwinds to fit(): the run's last checkpoint could not be written (args: why, and the line to say)."""


class TrainingDiverged(SystemExit):
    """Raised on every process after a non-finite loss (see loss_guard.LossGuard):
    the process exits with NONFINITE_EXIT_STATUS, without writing a checkpoint."""

    def __init__(self):
        super().__init__(NONFINITE_EXIT_STATUS)


@dataclasses.dataclass
class _Progress:
    """How far fit() got: the epochs it ran and since when, for its result however it ends."""

    checkpointer: Checkpointer
    started: float = dataclasses.field(default_factory=time.perf_counter)
    epochs_run: int = 0

    def result(self) -> FitResult:
        return FitResult(epochs_run=self.epochs_run, seconds=time.perf_counter() - self.started,
                         best_acc1=self.checkpointer.best_acc1, best_epoch=self.checkpointer.best_epoch,
                         best_source=self.checkpointer.best_source)


@dataclasses.dataclass(frozen=True)
class Validation:
    """An epoch's validation: the model's, and with --model-ema its average's
    (`ema`); the better top-1 of the two (the model's on a tie) is `source`'s,
    and `report` is its per-class report."""

    val: EpochMetrics
    report: ClassReport
    ema: Optional[EpochMetrics] = None
    source: str = "model"  # "model" or "ema"

    @property
    def top1(self) -> float:
        return self.ema.top1 if self.source == "ema" else self.val.top1


def validate(trainer: Trainer, loaders: Loaders, epoch: int, averaged: bool, predictions: Sequence = ()) -> Validation:
    """The model validated, and `averaged`: --model-ema's average beside it
    (a second pass over the same images, each counted once as in the first);
    `predictions`: each pass's per-image record (--evaluate: common.evaluation)."""
    model_predictions, ema_predictions = (*predictions, None, None)[:2]
    val, report = trainer.validate(loaders, epoch, predictions=model_predictions)
    if not averaged:
        return Validation(val, report)
    ema, ema_report = trainer.validate(loaders, epoch, averaged=True, predictions=ema_predictions)
    if ema.top1 > val.top1:
        return Validation(val, ema_report, ema, "ema")
    return Validation(val, report, ema, "model")


def fit(trainer: Trainer, loaders: Loaders, epochs: int, start: ResumePoint,
        io_sampler: Optional[measure.IOSampler] = None, desired_acc: Optional[float] = None) -> FitResult:
    """Train and validate epochs start.start_epoch .. epochs-1 (the first
    from start's step on); after each, log the metrics and write a
    checkpoint (trainer.checkpointer). Stops early once validation top-1
    reaches `desired_acc` (percent); on a stop signal, stops at a step all
    processes agree on, after a checkpoint there, and raises
    TrainingStopped (after `scontrol requeue` when it asks for one)."""
    log, control, ctx = trainer.log, trainer.control, trainer.ctx
    progress = _Progress(trainer.checkpointer)
    if start.start_epoch >= epochs:
        log.info(f"nothing to do: the checkpoint is at epoch {start.start_epoch} and --epochs is {epochs}")
    try:
        with control:
            for epoch in range(start.start_epoch, epochs):
                reached = _run_epoch(trainer, loaders, epoch, epochs, start, io_sampler, desired_acc, progress)
                if reached:
                    break
    except StopRequested as stop:
        _stopped(trainer, stop, progress, io_sampler)
    except NonFiniteLoss as problem:
        _diverged(trainer, problem, progress, io_sampler)
    except DataTimeout:  # its line, and the checkpoint where one could be written: common.engine's Trainer.stalled
        control.ignore_signals()
        if not spans_processes(ctx):  # with peers left waiting in a collective, closing the logs would wait too
            _finish(log, progress.result(), io_sampler, ctx, stopped=True)
        raise
    except _LastCheckpointFailed as problem:
        control.ignore_signals()
        _end_without_checkpoint(log, progress.result(), io_sampler, ctx, control, trainer.checkpointer,
                                problem.args[0], f"stopping: {problem.args[1]}")
    _finish(log, progress.result(), io_sampler, ctx)
    return progress.result()


def _run_epoch(trainer: Trainer, loaders: Loaders, epoch: int, epochs: int, start: ResumePoint,
               io_sampler: Optional[measure.IOSampler], desired_acc: Optional[float], progress: _Progress) -> bool:
    """Epoch `epoch`: trained, validated, logged and checkpointed; a stop
    signal met on the way is raised (StopRequested). Returns whether
    validation reached `desired_acc`."""
    log, control, checkpointer, ctx = trainer.log, trainer.control, trainer.checkpointer, trainer.ctx
    trained = trainer.train_one_epoch(loaders, epoch, start if epoch == start.start_epoch else None)
    where = f"the end of epoch {epoch}'s training (step {trained.steps}/{trained.steps})"

    def checkpoint_before_validation():
        return trainer.save_mid_epoch(epoch, trained.steps, trained.steps, trained.images_done, trained.partial,
                                      stopping=True)

    decision = control.now()
    if decision.stop:  # before validation, which can take minutes: the grace period may be short
        path, failure = checkpoint_before_validation()
        raise StopRequested(decision, path, where, failure)
    try:
        validated = validate(trainer, loaders, epoch, averaged=trainer.ema is not None)
    except DataTimeout as stall:
        raise trainer.stalled(stall, f"{where}, in validation", checkpoint_before_validation) from None
    progress.epochs_run += 1
    is_best = checkpointer.validated(validated.top1, epoch, validated.source)  # the better of model and EMA
    log.io_samples(measure.gather_io_rows(io_sampler, ctx, epoch=epoch, read_bytes=trainer.read_bytes))  # a collective
    log.epoch_end(trained.metrics, validated.val, validated.report, loaders.classes, checkpointer.best_acc1,
                  checkpointer.best_epoch, validated.ema, validated.source, checkpointer.best_source)
    path, failure = saved_or_why(lambda: checkpointer.save(epoch + 1, 0, 0, None, is_best))
    reached = desired_acc is not None and validated.top1 >= desired_acc
    if reached or epoch + 1 >= epochs:  # the run's last checkpoint: every process ends alike
        failure = broadcast_from_primary(failure, ctx)
        if failure is not None:
            raise _LastCheckpointFailed(failure, f"could not write the checkpoint at the end of epoch "
                                                 f"{epoch}, the run's last ({failure})")
    elif failure is not None:  # the weights are still in memory: going on keeps them, stopping not
        log.info(f"warning: could not write the checkpoint at the end of epoch {epoch} ({failure}); "
                 f"training goes on, and the next checkpoint tries again (the newest on disk: "
                 f"{checkpointer.last_path or 'none'})")
        log.write_failed("checkpoints", failure, later=None)
    if reached:
        log.info(f"reached --desired-acc {desired_acc:g}% (val top-1 {validated.top1:.2f}%"
                 f"{' of the EMA' if validated.source == 'ema' else ''}) at epoch "
                 f"{epoch} after {time.perf_counter() - progress.started:.1f} s: stopping")
        return True
    decision = control.now()
    if decision.stop and epoch + 1 < epochs:
        raise StopRequested(decision, path, f"the end of epoch {epoch}", failure)
    return False


def _stopped(trainer: Trainer, stop: StopRequested, progress: _Progress,
             io_sampler: Optional[measure.IOSampler]) -> None:
    """After a stop's checkpoint: close the logs, requeue the Slurm job when
    the signal asks for it, and raise TrainingStopped (STOPPED_EXIT_STATUS)."""
    log, control, ctx = trainer.log, trainer.control, trainer.ctx
    control.ignore_signals()
    failure = broadcast_from_primary(stop.failure, ctx)  # every process stopped here: they end alike
    if failure is not None:  # no requeue: a job started again would meet the same full disk
        _end_without_checkpoint(log, progress.result(), io_sampler, ctx, control, trainer.checkpointer, failure,
                                f"stopping at {stop.where} on {stop.decision.signal_name} (every process at "
                                f"this step): could not write its checkpoint ({failure})")
    log.info(f"stopping at {stop.where} on {stop.decision.signal_name} (every process at this step): "
             f"checkpoint saved to {stop.path}")
    _finish(log, progress.result(), io_sampler, ctx, stopped=True)
    if log.is_primary and stop.decision.requeue and preemption.should_requeue(control.requeue):
        preemption.requeue_slurm_job(log)
    # Everyone leaves together, after the primary's checkpoint and requeue: a launcher that stops the
    # job at a process's exit (srun --kill-on-bad-exit, torchrun) must not cut the checkpoint short.
    control.barrier()
    raise TrainingStopped(stop.decision.signal_name)


def _diverged(trainer: Trainer, problem: NonFiniteLoss, progress: _Progress,
              io_sampler: Optional[measure.IOSampler]) -> None:
    """A non-finite loss, on every process at the same step: say where and
    what to do, write nothing more, raise TrainingDiverged."""
    log, control, checkpointer = trainer.log, trainer.control, trainer.checkpointer
    control.ignore_signals()
    if checkpointer.last_path is not None:
        what_now = (f"the weights since then are not saved and the last good checkpoint is "
                    f"{checkpointer.last_path} (continue from it with --resume and a lower --lr or more "
                    f"--warmup-epochs)")
    else:
        what_now = "no checkpoint was written before it (start again with a lower --lr or more --warmup-epochs)"
    log.info(f"stopping: {problem}; {what_now}")
    _finish(log, progress.result(), io_sampler, trainer.ctx, stopped=True)
    control.barrier()  # the primary's line is out before any launcher stops the job at an exit
    raise TrainingDiverged()


def _end_without_checkpoint(log: RunLog, result: FitResult, io_sampler: Optional[measure.IOSampler], ctx: Context,
                            control: StopControl, checkpointer: Checkpointer, why: str, what: str) -> None:
    """A checkpoint the run cannot end without was not written (`why`): one
    line (`what`) says so and names the newest checkpoint on disk; then, on
    every process, the logs are closed and the run exits with WRITE_FAILED_EXIT_STATUS."""
    log.write_failed("checkpoints", why, later=None)  # named so at the finish
    newest = checkpointer.last_path
    if newest is not None:
        then = f"the newest checkpoint is {newest}: free some space there and continue with --resume {newest}"
    else:
        then = "no checkpoint was written: free some space where --logdir is and start again"
    log.info(f"{what}; the weights since then are not saved; {then}")
    _finish(log, result, io_sampler, ctx, stopped=True)
    control.barrier()  # the primary's line is out before any launcher stops the job at an exit
    raise CheckpointNotWritten()


def _finish(log: RunLog, result: FitResult, io_sampler: Optional[measure.IOSampler], ctx: Context,
            stopped: bool = False) -> None:
    """The last I/O samples (a collective: every process calls this), then the closing lines."""
    log.io_samples(measure.gather_io_rows(io_sampler, ctx, final=True))
    log.finish(result, stopped=stopped)


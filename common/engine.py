"""The one training loop, for every script: Trainer (a step, an epoch, a
validation pass), fit (epochs, checkpoints, stops) and run (what every
entry script ends with: resume, the run directory, then fit or --evaluate).

The entry scripts differ only in how the model is wrapped and how the
processes find each other; everything here runs unchanged for one device,
DataParallel and DDP. Metrics stay on the device as sums during an epoch;
the host reads them only at print intervals and once per epoch.

Before each training step every process asks common.preemption.StopControl
what to do; the answer is the same on all of them: go on, write a
checkpoint here (--checkpoint-every), or write one and stop (a signal).
Randomness is a function of the position only (the data's per image, see
common.data; dropout's per step, reseeded here), so training resumed from a
checkpoint at step S of epoch E is the same as training that never stopped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function
from torch.optim import Optimizer

from common import checkpoint, measure, preemption
from common.checkpoint import Checkpointer, ResumePoint, RunFacts
from common.comm import CommHook
from common.config import Config
from common.data import BadImages, Loaders, derived_seed
from common.device_input import DeviceInput
from common.distributed import (Context, all_reduce_sum, all_reduce_sum_started, broadcast_buffers_from_primary,
                                broadcast_from_primary)
from common.errors import NONFINITE_EXIT_STATUS, WRITE_FAILED_EXIT_STATUS, UsageError, one_line
from common.measure import StepTimer
from common.meters import ClassReport, EpochMetrics, MetricSums, MetricTotals, SplitTiming
from common.preemption import Decision, StopControl, TrainingStopped
from common.rundir import RunDirectory
from common.schedules import LRSchedule, set_lr
from common.telemetry import RunLog


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU): initialisation is a
    function of the seed (DDP copies rank 0's weights to every process);
    during training the data's randomness is seeded per image (common.data)
    and the model's (dropout) per step (Trainer). On the CPU that is enough
    for bit-identical runs. On GPUs, `deterministic` also rules out the
    algorithms whose sums come out in a varying order: cuDNN's autotuned and
    atomics-based convolutions, cuBLAS's split-K reductions (which need the
    fixed workspace set here, before the first cuBLAS call) and the CUDA
    kernels PyTorch lists as non-deterministic. Ops that have no
    deterministic CUDA version at all (the backward of AdaptiveAvgPool2d,
    which ResNet, VGG and AlexNet end with) warn once instead of failing."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)


def seed_generators(seed: int, devices) -> None:
    """torch.manual_seed(seed) for the generators a training step draws from:
    the CPU's and those of `devices` (GPUs). torch.manual_seed itself also
    seeds every accelerator type torch knows (CUDA, MPS, XPU, MTIA), and for
    each one not initialised (XPU and MTIA on an NVIDIA GPU, CUDA too in a
    CPU run) it queues the call with a formatted copy of the Python stack.
    In a CPU run's loop (2-core EPYC, torch 2.14, --profile-steps) the step's
    "seed, lr, guard" part took 0.42-0.44 ms with it and 0.08-0.09 ms with this."""
    torch.default_generator.manual_seed(seed)
    for device in devices:
        if device.type == "cuda":
            # default_generators is empty until CUDA is initialised (found on an H200, 2026-11-26: a call before
            # the model reached the GPU failed with an IndexError); init() is a flag check once it is.
            torch.cuda.init()
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)


def sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float,
        loss_scaling: bool = False) -> torch.optim.SGD:
    """SGD with momentum and weight decay, in as few kernel launches as the
    parameters' device allows (sgd_implementation). The same arithmetic as
    the per-parameter loop, within floating-point rounding. `loss_scaling`:
    a GradScaler (fp16) may skip steps."""
    parameters = list(model.parameters())
    on_gpu = bool(parameters) and all(parameter.is_cuda for parameter in parameters)
    return torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           **sgd_implementation(on_gpu, loss_scaling))


def sgd_implementation(on_gpu: bool, loss_scaling: bool) -> dict:
    """fused (one kernel for all parameters) on GPUs, foreach (a few
    multi-tensor kernels) elsewhere and under fp16 loss scaling: torch's fused
    SGD (2.11 to 2.15 at least) writes its momentum buffers on a step the
    GradScaler skips for overflowing gradients, and on the first step leaves
    them uninitialised, so the routine overflow of the first fp16 steps turns
    the weights to NaN one step later (tests/test_precision.py shows it)."""
    return {"fused": True} if on_gpu and not loss_scaling else {"foreach": True}


@dataclasses.dataclass(frozen=True)
class FitResult:
    epochs_run: int
    seconds: float  # wall time of this call, validation and checkpoints included
    best_acc1: float
    best_epoch: Optional[int]


class _Stop(Exception):
    """Unwinds from the training loop to fit() once the stop's checkpoint is
    written, or its write failed (`failure`: why, on the primary)."""

    def __init__(self, decision: Decision, path: Optional[Path], where: str, failure: Optional[str] = None):
        super().__init__(decision.signal_name)
        self.decision = decision
        self.path = path
        self.where = where  # "epoch E step S/N": where every process stopped
        self.failure = failure


class CheckpointNotWritten(SystemExit):
    """Raised on every process when a checkpoint the run cannot end without
    (its last, or a stop's) could not be written: exit WRITE_FAILED_EXIT_STATUS."""

    def __init__(self):
        super().__init__(WRITE_FAILED_EXIT_STATUS)


class _LastCheckpointFailed(Exception):
    """Unwinds to fit(): the run's last checkpoint could not be written (args: why, and the line to say)."""


class TrainingDiverged(SystemExit):
    """Raised on every process after a non-finite loss (see LossGuard): the
    process exits with NONFINITE_EXIT_STATUS, without writing a checkpoint."""

    def __init__(self):
        super().__init__(NONFINITE_EXIT_STATUS)


class _NonFinite(Exception):
    """Unwinds from the training loop to fit(): the message says where."""


class LossGuard:
    """Watches for a NaN or inf training loss on any process. Each step's
    flag is summed over processes, so every process sees the same answer
    and acts alike.

    With no tolerance (the default) the flag of step S is read during step
    S + 1, after that step's forward pass is queued; on a GPU it travels to
    the host by an asynchronous copy that was queued right behind it, so the
    read does not wait for the device and the device never waits for the
    host. Step S's update has then been applied, but those weights are
    never saved (settle() runs before every checkpoint) and the run stops:
    the last good checkpoint stays the newest. With a tolerance of N, the
    flag is read before the update (the host waits for the forward pass
    every step), so up to N bad steps are skipped, their updates never applied."""

    def __init__(self, ctx: Context, tolerance: int = 0):
        self.ctx = ctx
        self.tolerance = tolerance
        self.skipped = 0  # bad steps skipped by this process so far
        self._pending = None  # (flags, reduction, copied, epoch, step, lr) of the step not yet checked

    def allows_update(self, loss: torch.Tensor, epoch: int, step: int, lr: float) -> bool:
        """Note this step's loss; False when its update must be skipped.
        Raises _NonFinite for a bad step that is not tolerated (this one's
        with a tolerance, else the previous one's)."""
        loss = loss.detach().float()
        flags = torch.stack([loss.isnan(), loss.isinf()]).to(torch.float32)  # processes with a NaN, an inf loss
        reduction = all_reduce_sum_started(flags, self.ctx)
        copied = None
        if flags.is_cuda:
            if reduction is not None:
                reduction.wait()  # NCCL: orders the device stream after the sum; the host does not wait
                reduction = None
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            flags = host
        checked = (flags, reduction, copied, epoch, step, lr)
        if not self.tolerance:
            checked, self._pending = self._pending, checked
            self._raise_if_bad(checked)
            return True
        problem = self._problem(checked)
        if problem is None:
            return True
        self.skipped += 1
        if self.skipped > self.tolerance:
            raise _NonFinite(f"{problem}, more than --max-nonfinite-steps {self.tolerance}")
        return False

    def buffers_before(self, model: nn.Module) -> Optional[list]:
        """With a tolerance: copies of the model's buffers, to undo what a
        skipped step's forward pass did to them (BatchNorm's running
        statistics would keep a NaN for good). Buffers are small next to the
        weights (ResNet-50: 0.2 MB of 98 MB)."""
        return [buffer.detach().clone() for buffer in model.buffers()] if self.tolerance else None

    @staticmethod
    def restore_buffers(model: nn.Module, saved: list) -> None:
        with torch.no_grad():
            for buffer, before in zip(model.buffers(), saved):
                buffer.copy_(before)

    def check_weights(self, model: nn.Module, where: str) -> None:
        """Before a checkpoint: the weights and buffers are finite on every
        process (a finite loss can still have non-finite gradients)."""
        tensors = [tensor for tensor in (*model.parameters(), *model.buffers()) if tensor.is_floating_point()]
        if not tensors:
            return
        bad = torch.stack([~torch.isfinite(tensor).all() for tensor in tensors]).sum().to(torch.float32).reshape(1)
        if all_reduce_sum(bad, self.ctx).item():
            raise _NonFinite(f"{where}: {int(bad.item())} weight or buffer tensor(s) are not finite on some "
                             f"process, although the losses were")

    def settle(self) -> None:
        """Check the step not yet checked (before a checkpoint, and at an epoch's end)."""
        checked, self._pending = self._pending, None
        self._raise_if_bad(checked)

    def _raise_if_bad(self, checked) -> None:
        problem = self._problem(checked)
        if problem is not None:
            raise _NonFinite(problem)

    def _problem(self, checked) -> Optional[str]:
        if checked is None:
            return None
        flags, reduction, copied, epoch, step, lr = checked
        if reduction is not None:  # gloo
            reduction.wait()
        if copied is not None:
            copied.synchronize()
        nans, infs = (int(count) for count in flags.tolist())
        if not nans and not infs:
            return None
        kinds = " and ".join(f"{kind} on {count} of {self.ctx.world_size} process(es)"
                             for kind, count in (("NaN", nans), ("inf", infs)) if count)
        return f"epoch {epoch} step {step}: the training loss is {kinds} (lr {lr:g})"


@dataclasses.dataclass
class Trainer:
    """A training step, an epoch of them and a validation pass, on every
    process alike; fit() runs them over the epochs. One piece: the step,
    the epoch and validation share the model, the precision policy, the
    loss guard, the stop control, the input stage and the profiler, and
    each part of the loop is a few lines of it (labelled for the profiler)."""

    model: nn.Module  # as the script wrapped it (plain, DataParallel or DDP)
    criterion: nn.Module
    optimizer: Optimizer
    schedule: LRSchedule
    precision: object  # a common.precision policy
    ctx: Context
    log: RunLog
    print_freq: int = 10
    channels_last: bool = False
    steps_per_epoch: int = 0  # 0: whole epochs
    warmup_steps: int = 10  # first steps of each split left out of the throughput figures
    max_nonfinite_steps: int = 0  # NaN/inf-loss steps skipped before the run stops (see LossGuard), unless `guard`
    # Signals, stops and periodic checkpoints; NoStops: none of them (a Trainer used on its own).
    control: StopControl = dataclasses.field(default_factory=preemption.NoStops)
    checkpointer: Optional[Checkpointer] = None  # None: no checkpoints (then `control` must ask for none)
    guard: Optional["LossGuard"] = None  # None: a LossGuard of its own, with max_nonfinite_steps
    # Where training stands after train_one_epoch, should a stop come before validation ends (see fit):
    # (steps, images done, _PartialEpoch).
    trained: Optional[tuple] = dataclasses.field(default=None, init=False)
    # The splits whose images above Pillow's decompression-bomb limit were counted and named: once a run each.
    large_images_noted: set = dataclasses.field(default_factory=set, init=False)
    profile_steps: int = 0  # --profile-steps: training steps profiled, once a run (measure.StepProfiler)
    profiled: bool = dataclasses.field(default=False, init=False)
    accum_steps: int = 1  # --accum-steps: micro-batches per optimizer step

    def __post_init__(self):
        self.guard = self.guard or LossGuard(self.ctx, self.max_nonfinite_steps)
        self._input = DeviceInput(self.ctx.device, self.channels_last)  # batches finished on the device

    def _should_print(self, step: int, steps: int) -> bool:
        return self.log.is_primary and ((step + 1) % self.print_freq == 0 or step + 1 == steps)

    def train_one_epoch(self, loaders: Loaders, epoch: int, start: Optional[ResumePoint] = None) -> EpochMetrics:
        """Train one epoch, or the rest of it after the mid-epoch checkpoint `start`."""
        self.model.train()
        images_done = start.images_done if start is not None else 0
        step_numbers = loaders.set_epoch(epoch, images_done, self.steps_per_epoch)
        steps = step_numbers.stop
        before = _PartialEpoch.from_dict(start.partial_epoch if start is not None else None)
        sums = MetricSums(self.ctx.device)
        progress = self.log.progress_meter("train", epoch, steps, first_step=step_numbers.start)
        timer = StepTimer(len(step_numbers), self.warmup_steps, self.ctx.devices)
        bad_images = BadImages(loaders.train.dataset)
        batches = iter(self._input(loaders.train, loaders.dali))
        profiler = self._profiler(epoch, step_numbers.start)
        lr = None
        try:
            for step in step_numbers:
                with record_function("step:stop control"):
                    decision = self.control.step(epoch * steps + step)
                if decision.checkpoint or decision.stop:
                    self.guard.settle()  # never a checkpoint of weights a non-finite loss has touched
                    with timer.paused():
                        partial = before.plus(_PartialEpoch.measure(sums, timer, self.ctx, bad_images))
                        path, failure = _saved_or_why(lambda: self.checkpointer.save_mid_epoch(
                            epoch, step, images_done + (step - step_numbers.start) * loaders.global_batch,
                            partial.to_dict(), steps, stopping=decision.stop, log=self.log))
                    if decision.stop:
                        raise _Stop(decision, path, f"epoch {epoch} step {step}/{steps}", failure)
                with record_function("step:data"):
                    batch = next(batches)
                timer.batch_ready()
                with record_function("step:seed, lr, guard"):
                    # Dropout (and any other randomness in the model) draws from a seed of this step: the same
                    # in a run resumed here as in one that never stopped.
                    seed_generators(derived_seed(loaders.seed, epoch, step, self.ctx.rank), self.ctx.devices)
                    lr = self.schedule.lr(epoch, step, steps)
                    set_lr(self.optimizer, lr)
                    buffers = self.guard.buffers_before(self.model)
                # --accum-steps N: the first N - 1 micro-batches add their gradients (each loss / N) without
                # DDP's exchange; the last one's backward exchanges the sum, then one optimizer step.
                if self.accum_steps > 1:
                    self.optimizer.zero_grad(set_to_none=True)
                micro = []
                for index in range(self.accum_steps):
                    if index:  # the step's later micro-batches: their wait is data wait too
                        with record_function("step:data"):
                            batch = timer.waiting(lambda: next(batches))
                    micro.append(self._accumulated(batch, bad_images, backward=index < self.accum_steps - 1))
                loss = micro[0].loss if len(micro) == 1 else sum(part.loss for part in micro) / len(micro)
                if self.guard.allows_update(loss, epoch, step, lr):
                    with record_function("step:backward and optimizer"):
                        if len(micro) == 1:
                            self.precision.backward_and_step(micro[0].loss, self.optimizer)
                        else:
                            self.precision.backward(micro[-1].loss / len(micro))
                            self.precision.step(self.optimizer)
                    with record_function("step:metric sums"):
                        for part in micro:
                            sums.add(part.loss, part.logits, part.target, timed=timer.timing, **part.files)
                else:  # a tolerated non-finite loss: no update, no trace in the buffers or the epoch's figures
                    self.guard.restore_buffers(self.model, buffers)
                    self.log.info(f"warning: epoch {epoch} step {step}: the training loss is not finite; step skipped "
                                  f"({self.guard.skipped} of --max-nonfinite-steps {self.guard.tolerance})")
                    for part in micro:
                        sums.add_files(**part.files)
                if self._should_print(step, steps):  # the one host sync per interval
                    status = self.precision.status()
                    progress.show(step, sums.totals(), timer, lr, status)
                    self.log.explain_skipped_steps(status)
                timer.step_done()
                if profiler is not None:
                    with timer.paused():  # writing the profile, after its last step, is not the epoch's time
                        profiler.step()
        finally:  # also when a stop or an error leaves the epoch: the profile so far is written
            if profiler is not None:
                self.log.info(profiler.close())
        self.guard.settle()
        totals = before.totals.plus(sums.totals(self.ctx))  # summed over processes
        bad_files = _report_bad_images(self.log, self.ctx, epoch, "train", totals, bad_images, before.bad_files)
        self._note_large_images("train", epoch, totals, bad_images)
        timing = timer.finish(self.ctx, before.timing)
        if lr is None and steps:  # every step ran before the checkpoint this run resumed from
            lr = self.schedule.lr(epoch, steps - 1, steps)
        self.trained = (steps, images_done + len(step_numbers) * loaders.global_batch,
                        _PartialEpoch(totals=totals, timing=timing, bad_files=bad_files))
        return EpochMetrics.from_totals(epoch, "train", totals, timing, self.ctx.replicas, lr, time.time(),
                                        self.precision.status())

    def _accumulated(self, batch, bad_images: BadImages, backward: bool = False) -> "_MicroBatch":
        """One micro-batch's forward pass (and, for all but a step's last,
        `backward`, its backward pass without DDP's exchange, the loss divided
        by --accum-steps as the step's mean over them needs). Both under
        no_sync(): DDP arms its exchange for the backward during the forward."""
        with self._no_sync() if backward else contextlib.nullcontext():
            with record_function("step:forward"), self.precision.autocast():
                logits = self.model(batch.image)
                loss = self.criterion(logits, batch.target)
            if backward:
                with record_function("step:backward (accumulating)"):
                    self.precision.backward(loss / self.accum_steps)
        files = dict(file_bytes=int(batch.file_bytes.sum()), bad_images=bad_images.count(batch),
                     large_images=bad_images.count_large(batch))
        return _MicroBatch(loss, logits, batch.target, files)

    def _no_sync(self):
        """DDP's no_sync(): gradients add up locally, exchanged at the next synchronised backward."""
        return self.model.no_sync() if hasattr(self.model, "no_sync") else contextlib.nullcontext()

    def _profiler(self, epoch: int, first_step: int) -> Optional[measure.StepProfiler]:
        """--profile-steps: on the primary, in the first epoch this run trains; None otherwise."""
        if not self.profile_steps or self.profiled or not self.log.is_primary or self.log.run_dir is None:
            return None
        self.profiled = True
        return measure.StepProfiler.in_run(self.log.run_dir, epoch, first_step, self.profile_steps, self.warmup_steps,
                                           self.ctx.device)

    def _note_large_images(self, split: str, epoch: int, totals: MetricTotals, bad_images: BadImages) -> None:
        """A collective when there are some (the totals are the same on every process)."""
        if totals.large_images and split not in self.large_images_noted:
            self.large_images_noted.add(split)
            note = bad_images.large_note(self.ctx, totals.large_images, f"{split} epoch {epoch}")
            if note:
                self.log.info(note)

    @torch.no_grad()
    def validate(self, loaders: Loaders, epoch: int) -> Tuple[EpochMetrics, ClassReport]:
        """Loss, top-1/top-5 and the per-class report over the whole
        validation set, each image counted once whatever the number of
        processes (the confusion matrix is summed over them)."""
        # DDP's own module: DDP adds nothing in evaluation, and processes may have one batch more or
        # less than others here, which a collective inside DDP's forward would wait on forever.
        model = self.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            broadcast_buffers_from_primary(model, self.ctx)
        model.eval()
        loader = loaders.val
        steps = len(loader)
        sums = MetricSums(self.ctx.device, loaders.num_classes)
        progress = self.log.progress_meter("val", epoch, steps)
        # The primary's shard is the largest (ShardSampler): its step count decides everyone's warm-up.
        primary_steps = math.ceil(math.ceil(len(loader.dataset) / self.ctx.world_size) / loader.batch_size)
        timer = StepTimer(primary_steps, self.warmup_steps, self.ctx.devices)
        bad_images = BadImages(loader.dataset)
        for step, batch in enumerate(self._input(loader, loaders.dali)):
            timer.batch_ready()
            images, target = batch.image, batch.target
            files = dict(file_bytes=int(batch.file_bytes.sum()), bad_images=bad_images.count(batch),
                         large_images=bad_images.count_large(batch))
            if files["bad_images"]:  # stand-ins for unreadable files: validation counts each readable image once
                readable = (batch.bad_index < 0).to(images.device)
                images, target = images[readable], target[readable]
            if len(target):
                with self.precision.autocast():
                    logits = model(images)
                    loss = self.criterion(logits, target)
                sums.add(loss, logits, target, timed=timer.timing, **files)
            else:
                sums.add_files(**files)
            if self._should_print(step, steps):
                progress.show(step, sums.totals(), timer, None)
            timer.step_done()
        totals = sums.totals(self.ctx)
        _report_bad_images(self.log, self.ctx, epoch, "val", totals, bad_images)
        self._note_large_images("val", epoch, totals, bad_images)
        report = sums.class_report(self.ctx)
        metrics = EpochMetrics.from_totals(epoch, "val", totals, timer.finish(self.ctx), self.ctx.replicas, None,
                                           time.time(), macro_f1=report.macro_f1)
        return metrics, report


def _report_bad_images(log: RunLog, ctx: Context, epoch: int, split: str, totals: MetricTotals,
                       bad_images: BadImages, earlier: tuple = ()) -> tuple:
    """Log the split's unreadable files, with those `earlier` in the epoch
    (before the checkpoint this run resumed from); returns them all (on the
    primary) as (path, reason) pairs. A collective when there are any."""
    if not totals.bad_images:
        return ()
    files = {**dict(earlier), **bad_images.gathered(ctx, totals.bad_images)}
    log.bad_images(epoch, split, totals.bad_images, files)
    return tuple(files.items())


def fit(trainer: Trainer, loaders: Loaders, epochs: int, start: ResumePoint,
        io_sampler: Optional[measure.IOSampler] = None, desired_acc: Optional[float] = None) -> FitResult:
    """Train and validate epochs start.start_epoch .. epochs-1 (the first
    from start's step on); after each, log the metrics and write a
    checkpoint (trainer.checkpointer). Stops early once validation top-1
    reaches `desired_acc` (percent); on a stop signal, stops at a step all
    processes agree on, after a checkpoint there, and raises
    TrainingStopped (after `scontrol requeue` when it asks for one)."""
    log, control, checkpointer, ctx = trainer.log, trainer.control, trainer.checkpointer, trainer.ctx
    fit_start = time.perf_counter()
    epochs_run = 0

    def result() -> FitResult:
        return FitResult(epochs_run=epochs_run, seconds=time.perf_counter() - fit_start,
                         best_acc1=checkpointer.best_acc1, best_epoch=checkpointer.best_epoch)

    if start.start_epoch >= epochs:
        log.info(f"nothing to do: the checkpoint is at epoch {start.start_epoch} and --epochs is {epochs}")
    try:
        with control:
            for epoch in range(start.start_epoch, epochs):
                train = trainer.train_one_epoch(loaders, epoch, start if epoch == start.start_epoch else None)
                decision = control.now()
                if decision.stop:  # before validation, which can take minutes: the grace period may be short
                    steps, images_done, partial = trainer.trained
                    path, failure = _saved_or_why(lambda: checkpointer.save_mid_epoch(
                        epoch, steps, images_done, partial.to_dict(), steps, stopping=True, log=log))
                    raise _Stop(decision, path, f"the end of epoch {epoch}'s training (step {steps}/{steps})", failure)
                val, report = trainer.validate(loaders, epoch)
                epochs_run += 1
                is_best = checkpointer.validated(val.top1, epoch)
                log.io_samples(measure.gather_io_rows(io_sampler, ctx))  # a collective
                log.epoch_end(train, val, report, loaders.classes, checkpointer.best_acc1, checkpointer.best_epoch)
                path, failure = _saved_or_why(lambda: checkpointer.save(epoch + 1, 0, 0, None, is_best))
                reached = desired_acc is not None and val.top1 >= desired_acc
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
                    log.info(f"reached --desired-acc {desired_acc:g}% (val top-1 {val.top1:.2f}%) at epoch "
                             f"{epoch} after {time.perf_counter() - fit_start:.1f} s: stopping")
                    break
                decision = control.now()
                if decision.stop and epoch + 1 < epochs:
                    raise _Stop(decision, path, f"the end of epoch {epoch}", failure)
    except _Stop as stop:
        # After a stop's checkpoint: close the logs, requeue the Slurm job when the signal asks for it,
        # and exit with STOPPED_EXIT_STATUS.
        control.ignore_signals()
        failure = broadcast_from_primary(stop.failure, ctx)  # every process stopped here: they end alike
        if failure is not None:  # no requeue: a job started again would meet the same full disk
            _end_without_checkpoint(log, result(), io_sampler, ctx, control, checkpointer, failure,
                                    f"stopping at {stop.where} on {stop.decision.signal_name} (every process at "
                                    f"this step): could not write its checkpoint ({failure})")
        log.info(f"stopping at {stop.where} on {stop.decision.signal_name} (every process at this step): "
                 f"checkpoint saved to {stop.path}")
        _finish(log, result(), io_sampler, ctx, stopped=True)
        if log.is_primary and stop.decision.requeue and preemption.should_requeue(control.requeue):
            preemption.requeue_slurm_job(log)
        # Everyone leaves together, after the primary's checkpoint and requeue: a launcher that stops the
        # job at a process's exit (srun --kill-on-bad-exit, torchrun) must not cut the checkpoint short.
        control.barrier()
        raise TrainingStopped(stop.decision.signal_name)
    except _NonFinite as problem:
        # On every process at the same step: say where and what to do, write nothing more.
        control.ignore_signals()
        if checkpointer.last_path is not None:
            what_now = (f"the weights since then are not saved and the last good checkpoint is "
                        f"{checkpointer.last_path} (continue from it with --resume and a lower --lr or more "
                        f"--warmup-epochs)")
        else:
            what_now = "no checkpoint was written before it (start again with a lower --lr or more --warmup-epochs)"
        log.info(f"stopping: {problem}; {what_now}")
        _finish(log, result(), io_sampler, ctx, stopped=True)
        control.barrier()  # the primary's line is out before any launcher stops the job at an exit
        raise TrainingDiverged()
    except _LastCheckpointFailed as problem:
        control.ignore_signals()
        _end_without_checkpoint(log, result(), io_sampler, ctx, control, checkpointer, problem.args[0],
                                f"stopping: {problem.args[1]}")
    _finish(log, result(), io_sampler, ctx)
    return result()


def _saved_or_why(save: Callable[[], Optional[Path]]) -> Tuple[Optional[Path], Optional[str]]:
    """The path of the checkpoint `save` writes, or None and why it could not
    (a full disk). Only the primary writes, so only it can fail: where the
    run cannot go on without the file, fit() tells the others."""
    try:
        return save(), None
    except OSError as error:
        return None, one_line(error.strerror or str(error))


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


def run(cfg: Config, ctx: Context, log: RunLog, model: nn.Module, optimizer: Optimizer, policy, loaders: Loaders, *,
        channels_last: bool, global_batch: int, lr: float, comm_hook: Optional[CommHook] = None
        ) -> Optional[FitResult]:
    """What every entry script ends with, once its model is built and wrapped
    (`comm_hook`: the DDP scripts' communication hook, whose state checkpoints
    keep) and its optimizer made: the LR schedule and loss of the recipe, --resume
    (to the step), then --evaluate's one validation pass, or the run
    directory, the configuration record and fit()."""
    # --opt-level auto, resolved now that the device is known: the run's name, config.json and the
    # checkpoint's recipe say what ran.
    cfg = dataclasses.replace(cfg, opt_level=policy.opt_level)
    log.info(policy.describe())
    if loaders.jpeg_decoder is not None:  # chosen once for the run (TorchCodec, torchvision.io or Pillow), and why
        log.info(loaders.jpeg_decoder.describe())
    if loaders.dali is not None:
        log.info(loaders.dali.describe())
    for note in loaders.notes:  # about the data: DATA unread, a folder under two classes
        log.info(note)
    if policy.warning:  # a half type this device emulates: said once, at the start, and kept in config.json
        log.info(policy.warning)
    if comm_hook is not None:
        log.info(comm_hook.describe(cfg.bucket_cap_mb, cfg.static_graph))
    schedule = LRSchedule(lr, cfg.epochs, cfg.lr_schedule, cfg.lr_steps, warmup_epochs=cfg.warmup_epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    # --resume: where the checkpoint stopped, to the step; otherwise --start-epoch.
    start = checkpoint.resume(cfg, ctx, model, optimizer, policy, loaders.classes, log, global_batch=global_batch,
                              lr=lr, comm_hook=comm_hook)

    guard = LossGuard(ctx, cfg.max_nonfinite_steps)

    def trainer(checkpointer: Optional[Checkpointer]) -> Trainer:
        return Trainer(model, criterion, optimizer, schedule, policy, ctx, log, print_freq=cfg.print_freq,
                       channels_last=channels_last, steps_per_epoch=cfg.steps_per_epoch,
                       warmup_steps=cfg.warmup_steps, control=StopControl.for_run(cfg, ctx) if checkpointer
                       else preemption.NoStops(), checkpointer=checkpointer, guard=guard,
                       profile_steps=cfg.profile_steps, accum_steps=cfg.accum_steps)

    if cfg.evaluate:
        # No run directory, so no lock: it writes none, and can check a checkpoint of a run in progress
        # (saves replace files by rename, so it reads a whole one).
        val, report = trainer(None).validate(loaders, start.start_epoch)
        log.evaluation(val, report, loaders.classes, report_dir=cfg.report_dir)
        return None
    accumulated = f" x {cfg.accum_steps} micro-batches" if cfg.accum_steps > 1 else ""
    log.info(f"global batch {global_batch} ({cfg.batch_size} per replica{accumulated} x {ctx.replicas}); "
             f"lr {cfg.lr:g} x {global_batch}/256 = {lr:g}, {cfg.lr_schedule} schedule")
    resolved = {
        "global_batch": global_batch, "lr": lr, "precision": policy.name,
        "precision_warning": policy.warning, "channels_last": channels_last,
        "num_classes": loaders.num_classes, "train_images": len(loaders.train.dataset),
        "val_images": len(loaders.val.dataset),
        "steps_per_epoch": loaders.train_steps(cfg.steps_per_epoch),
        "checkpoint_bytes": checkpoint.expected_bytes(model, optimizer),  # checked against the free space
        "jpeg_decoder": loaders.jpeg_decoder.to_dict() if loaders.jpeg_decoder is not None else None,
        "dali": loaders.dali.to_dict() if loaders.dali is not None else None,
    }
    run_dir = RunDirectory.open(cfg, ctx, resolved["checkpoint_bytes"])  # a collective; locks it on the primary
    try:
        if run_dir is not None and run_dir.resuming:
            set_aside = run_dir.set_aside_after(start.start_epoch, start.images_done, start.path)
            if set_aside is not None:
                log.info(f"resuming at epoch {start.start_epoch} step {start.step}, {set_aside}")
        failure = None
        try:
            log.start_run(cfg, start, resolved, run_dir)  # config.json: on the primary
        except UsageError as error:  # it could not be written (a full disk)
            failure = str(error)
        failure = broadcast_from_primary(failure, ctx)  # every process ends alike, none left waiting
        if failure is not None:
            raise UsageError(failure)
        io_sampler = measure.start_io_sampler(cfg, ctx)
        checkpointer = Checkpointer(model, optimizer, policy, ctx, RunFacts.of(cfg, global_batch, lr),
                                    loaders.classes, start, run_dir.path if run_dir is not None else None,
                                    guard.check_weights, comm_hook=comm_hook)
        return fit(trainer(checkpointer), loaders, cfg.epochs, start, io_sampler, desired_acc=cfg.desired_acc)
    finally:
        if run_dir is not None:  # ended, stopped or failed: the next run finds the lock released, not stale
            run_dir.close()


@dataclasses.dataclass(frozen=True)
class _MicroBatch:
    """What a step keeps of each of its micro-batches (--accum-steps) for the epoch's figures."""

    loss: torch.Tensor  # the micro-batch's mean loss
    logits: torch.Tensor
    target: torch.Tensor
    files: dict  # file bytes, unreadable and very large images (BadImages)


@dataclasses.dataclass(frozen=True)
class _PartialEpoch:
    """The training split's sums and timing over all processes, up to a
    mid-epoch checkpoint: the resumed epoch adds its own, so its metrics row
    counts every step once; and the unreadable files met so far (--bad-images
    skip; on the primary), so bad_images.csv lists them too."""

    totals: MetricTotals = MetricTotals(loss_sum=0.0, top1_correct=0, top5_correct=0, count=0)
    timing: SplitTiming = SplitTiming(steps=0, warmup_steps=0, seconds=0.0, timed_seconds=0.0, data_wait_seconds=0.0,
                                      all_timed_seconds=0.0)
    bad_files: tuple = ()  # (path, reason) pairs

    @staticmethod
    def measure(sums: MetricSums, timer: StepTimer, ctx: Context, bad_images: BadImages) -> "_PartialEpoch":
        """This part's figures (a collective: every process calls it at the same step)."""
        totals = sums.totals(ctx)
        bad_files = tuple(bad_images.gathered(ctx, totals.bad_images).items())
        return _PartialEpoch(totals=totals, timing=timer.finish(ctx), bad_files=bad_files)

    def plus(self, other: "_PartialEpoch") -> "_PartialEpoch":
        return _PartialEpoch(totals=self.totals.plus(other.totals), timing=self.timing.plus(other.timing),
                             bad_files=tuple({**dict(self.bad_files), **dict(other.bad_files)}.items()))

    def to_dict(self) -> dict:
        return {"totals": dataclasses.asdict(self.totals), "timing": dataclasses.asdict(self.timing),
                "bad_files": [list(pair) for pair in self.bad_files]}

    @staticmethod
    def from_dict(saved: Optional[dict]) -> "_PartialEpoch":
        if not saved:
            return _PartialEpoch()
        return _PartialEpoch(totals=MetricTotals(**saved["totals"]), timing=SplitTiming(**saved["timing"]),
                             bad_files=tuple(tuple(pair) for pair in saved.get("bad_files", ())))

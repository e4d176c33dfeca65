"""The one training loop: train_one_epoch, validate and fit, for every script.

The entry scripts differ only in how the model is wrapped and how the
processes find each other; everything here runs unchanged for one device,
DataParallel and DDP. Metrics stay on the device as sums during an epoch;
the host reads them only at print intervals and once per epoch.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from common import checkpoint
from common.checkpoint import ResumePoint
from common.data import Loaders
from common.distributed import Context, broadcast_buffers_from_primary
from common.meters import ClassReport, EpochMetrics, MetricSums
from common.schedules import LRSchedule, set_lr
from common.telemetry import RunLog, StepTimer


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU): initialisation is a
    function of the seed (DDP copies rank 0's weights to every process);
    each epoch's order and randomness are reseeded from (seed, epoch, rank)
    by Loaders.set_epoch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class FitResult:
    epochs_run: int
    seconds: float  # wall time of this call, validation and checkpoints included
    best_acc1: float
    best_epoch: Optional[int]


@dataclasses.dataclass
class Trainer:
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

    def _to_device(self, images: torch.Tensor, target: torch.Tensor):
        images = images.to(self.ctx.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, target.to(self.ctx.device, non_blocking=True)

    def _should_print(self, step: int, steps: int) -> bool:
        return self.log.is_primary and ((step + 1) % self.print_freq == 0 or step + 1 == steps)

    def train_one_epoch(self, loaders: Loaders, epoch: int) -> EpochMetrics:
        self.model.train()
        steps = loaders.train_steps(self.steps_per_epoch)
        sums = MetricSums(self.ctx.device)
        progress = self.log.progress_meter("train", epoch, steps)
        timer = StepTimer(steps, self.warmup_steps, self.ctx.devices)
        lr = None
        for step, (images, target, file_bytes) in enumerate(itertools.islice(loaders.train, steps)):
            timer.batch_ready()
            images, target = self._to_device(images, target)
            lr = self.schedule.lr(epoch, step, steps)
            set_lr(self.optimizer, lr)
            with self.precision.autocast():
                logits = self.model(images)
                loss = self.criterion(logits, target)
            self.precision.backward_and_step(loss, self.optimizer)
            sums.add(loss, logits, target, file_bytes=int(file_bytes.sum()), timed=timer.timing)
            if self._should_print(step, steps):  # the one host sync per interval
                status = self.precision.status()
                progress.show(step, sums.totals(), timer, lr, status)
                self.log.explain_skipped_steps(status)
            timer.step_done()
        totals = sums.totals(self.ctx)  # summed over processes
        return EpochMetrics.from_totals(epoch, "train", totals, timer.finish(self.ctx), self.ctx.replicas, lr,
                                        time.time(), self.precision.status())

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
        for step, (images, target, file_bytes) in enumerate(loader):
            timer.batch_ready()
            images, target = self._to_device(images, target)
            with self.precision.autocast():
                logits = model(images)
                loss = self.criterion(logits, target)
            sums.add(loss, logits, target, file_bytes=int(file_bytes.sum()), timed=timer.timing)
            if self._should_print(step, steps):
                progress.show(step, sums.totals(), timer, None)
            timer.step_done()
        totals = sums.totals(self.ctx)
        report = sums.class_report(self.ctx)
        metrics = EpochMetrics.from_totals(epoch, "val", totals, timer.finish(self.ctx), self.ctx.replicas, None,
                                           time.time(), macro_f1=report.macro_f1)
        return metrics, report

    def fit(self, loaders: Loaders, epochs: int, start: ResumePoint, *, arch: str, config: dict,
            desired_acc: Optional[float] = None) -> FitResult:
        """Train and validate epochs start.start_epoch .. epochs-1; after each,
        log the metrics and save a checkpoint (primary process only). Stops
        early once validation top-1 reaches `desired_acc` (percent)."""
        best_acc1, best_epoch = start.best_acc1, start.best_epoch
        fit_start = time.perf_counter()
        epochs_run = 0
        if start.start_epoch >= epochs:
            self.log.info(f"nothing to do: the checkpoint is at epoch {start.start_epoch} and --epochs is {epochs}")
        for epoch in range(start.start_epoch, epochs):
            loaders.set_epoch(epoch)
            train = self.train_one_epoch(loaders, epoch)
            val, report = self.validate(loaders, epoch)
            epochs_run += 1
            is_best = val.top1 > best_acc1
            if is_best:
                best_acc1, best_epoch = val.top1, epoch
            self.log.epoch_end(train, val, report, loaders.classes, best_acc1, best_epoch)
            if self.log.is_primary:
                state = checkpoint.training_state(
                    model=self.model, optimizer=self.optimizer, precision_state=self.precision.state_dict(),
                    next_epoch=epoch + 1, best_acc1=best_acc1, best_epoch=best_epoch, arch=arch,
                    classes=loaders.classes, config=config,
                )
                checkpoint.save(state, self.log.run_dir, is_best)
            if desired_acc is not None and val.top1 >= desired_acc:
                self.log.info(f"reached --desired-acc {desired_acc:g}% (val top-1 {val.top1:.2f}%) at epoch "
                              f"{epoch} after {time.perf_counter() - fit_start:.1f} s: stopping")
                break
        result = FitResult(epochs_run=epochs_run, seconds=time.perf_counter() - fit_start, best_acc1=best_acc1,
                           best_epoch=best_epoch)
        self.log.finish(result)
        return result

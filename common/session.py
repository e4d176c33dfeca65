"""A run assembled from its Config: every value the run derives from the
flags and its processes, computed once (Plan), and run(), the tail every
entry script ends with: the run directory opened and locked, the
checkpoint resumed from it, then fit() (common/fit.py) or --evaluate's one
validation pass.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.optim import Optimizer

from common import checkpoint, cuda_graphs, measure, preemption
from common.augment import BatchMixing
from common.checkpoint import Checkpointer, ResumePoint, RunFacts
from common.comm import CommHook
from common.config import Config
from common.cuda_graphs import GraphedStep
from common.data import Loaders
from common.distributed import Context, broadcast_from_primary
from common.ema import ModelEMA, adjusted_decay, describe as describe_ema
from common.engine import Trainer
from common.errors import UsageError
from common.evaluation import evaluate
from common.fit import FitResult, fit
from common.loss_guard import LossGuard
from common.models import uses_channels_last
from common.preemption import StopControl
from common.rundir import RunDirectory, auto_run_directory
from common.schedules import LRSchedule, scaled_lr
from common.telemetry import RunLog


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run derives from its flags, its processes and its precision
    policy, decided here once and read everywhere else."""

    config: Config  # the flags, with --opt-level auto resolved: the run's name, config.json, checkpoints
    global_batch: int  # images per optimizer step, all processes: -b x --accum-steps x replicas
    lr: float  # --lr is for a global batch of 256: scaled linearly to global_batch
    channels_last: bool  # --memory-format, resolved for this device and precision
    lr_min: float = 0.0  # --lr-min, scaled as --lr: the schedule's floor
    ema_decay: Optional[float] = None  # --model-ema: the decay per update after torchvision's adjustment; None: off

    @staticmethod
    def of(cfg: Config, ctx: Context, policy) -> "Plan":
        """`policy`: the script's common.precision policy, made for ctx.device."""
        global_batch = cfg.batch_size * cfg.accum_steps * ctx.replicas  # --accum-steps micro-batches per step
        return Plan(config=dataclasses.replace(cfg, opt_level=policy.opt_level), global_batch=global_batch,
                    lr=scaled_lr(cfg.lr, global_batch),
                    channels_last=uses_channels_last(cfg.memory_format, ctx.device, policy),
                    lr_min=scaled_lr(cfg.lr_min, global_batch),
                    ema_decay=adjusted_decay(cfg.model_ema_decay, global_batch, cfg.model_ema_steps, cfg.epochs)
                    if cfg.model_ema else None)

    @property
    def schedule(self) -> LRSchedule:
        """The learning rate at each step, from the schedule's flags and the scaled rates."""
        cfg = self.config
        return LRSchedule(self.lr, cfg.epochs, cfg.lr_schedule, cfg.lr_steps, warmup_epochs=cfg.warmup_epochs,
                          warmup_method=cfg.warmup_method, warmup_decay=cfg.warmup_decay, min_lr=self.lr_min)

    def model_ema(self, model: nn.Module, evaluating: bool = False) -> Optional[ModelEMA]:
        """--model-ema's average of `model` (for --evaluate of a checkpoint: one
        to restore a saved average into, which it may hold); None without."""
        cfg = self.config
        if not cfg.model_ema and not (evaluating and cfg.resume):
            return None
        decay = self.ema_decay if self.ema_decay is not None else cfg.model_ema_decay
        return ModelEMA(model, decay, cfg.model_ema_steps, cfg.warmup_epochs)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


def run(plan: Plan, ctx: Context, log: RunLog, model: nn.Module, optimizer: Optimizer, policy, loaders: Loaders,
        comm_hook: Optional[CommHook] = None) -> Optional[FitResult]:
    """What every entry script ends with, once its model is built and wrapped
    (`comm_hook`: the DDP scripts' communication hook, whose state checkpoints
    keep) and its optimizer made: --evaluate's one validation pass, or the run
    directory (opened and locked first), --resume (to the step) from it, the
    configuration record and fit()."""
    cfg = plan.config
    # The sampler cuts the epoch by its own count of the same three factors (it positions the images a
    # checkpoint resumes at); a disagreement would train one batch and log, scale and save another.
    if loaders.global_batch != plan.global_batch:
        raise RuntimeError(f"the training sampler's global batch {loaders.global_batch} is not the plan's "
                           f"{plan.global_batch} (-b x --accum-steps x replicas)")
    _describe_setup(log, policy, loaders, comm_hook, cfg)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    guard = LossGuard(ctx, cfg.max_nonfinite_steps)
    mixing = None if cfg.evaluate else _batch_mixing(cfg, loaders.num_classes, log)
    ema = plan.model_ema(model, evaluating=cfg.evaluate)
    graphed = _graphed_step(cfg, ctx, log, model, criterion, optimizer, policy, comm_hook)

    def trainer(checkpointer: Optional[Checkpointer]) -> Trainer:
        return Trainer(model, criterion, optimizer, plan.schedule, policy, ctx, log, print_freq=cfg.print_freq,
                       channels_last=plan.channels_last, steps_per_epoch=cfg.steps_per_epoch,
                       warmup_steps=cfg.warmup_steps, control=StopControl.for_run(cfg, ctx) if checkpointer
                       else preemption.NoStops(), checkpointer=checkpointer, guard=guard,
                       profile_steps=cfg.profile_steps, accum_steps=cfg.accum_steps, crop_sizes=cfg.crop_sizes,
                       val_flip=cfg.val_flip, compile=cfg.compile, mixing=mixing, ema=ema, graphed=graphed)

    def resume(auto_dir: Optional[Path]) -> ResumePoint:  # --resume: where the checkpoint stopped, to the step
        return checkpoint.resume(cfg, ctx, model, optimizer, policy, loaders.classes, log, ema=ema,
                                 global_batch=plan.global_batch, lr=plan.lr, comm_hook=comm_hook, auto_dir=auto_dir)

    if cfg.evaluate:
        # No run directory, so no lock: it writes none, and can check a checkpoint of a run in progress
        # (saves replace files by rename, so it reads a whole one).
        start = resume(auto_run_directory(cfg) if cfg.resume == "auto" else None)
        # The model, and the checkpoint's --model-ema average too if it holds one, on every set
        evaluate(trainer(None), loaders, start.start_epoch, start.has_ema, cfg, ctx, log)
        return None
    checkpoint_bytes = checkpoint.expected_bytes(model, optimizer, ema)  # checked against the free space
    # Opened and locked before the resume reads from it: a checkpoint another run is still writing is never read.
    run_dir = RunDirectory.open(cfg, ctx, checkpoint_bytes)  # a collective; the directory on the primary
    started = False
    try:
        start = resume(run_dir.path if run_dir is not None else None)
        if run_dir is not None and run_dir.resuming:
            set_aside = run_dir.set_aside_after(start.start_epoch, start.images_done, start.path)
            if set_aside is not None:
                log.info(f"resuming at epoch {start.start_epoch} step {start.step}, {set_aside}")
        _start_run(plan, ctx, log, model, optimizer, policy, loaders, start, run_dir, checkpoint_bytes)
        started = True
        io_sampler = measure.start_io_sampler(cfg, ctx)
        checkpointer = Checkpointer(model, optimizer, policy, ctx, RunFacts.of(cfg, plan.global_batch, plan.lr),
                                    loaders.classes, start, run_dir.path if run_dir is not None else None,
                                    guard.check_weights, comm_hook=comm_hook, ema=ema)
        return fit(trainer(checkpointer), loaders, cfg.epochs, start, io_sampler, desired_acc=cfg.desired_acc)
    finally:
        log.end_trackers_after_error()  # after log.finish (an end, a stop) this does nothing
        if run_dir is not None:  # ended, stopped or failed: the next run finds the lock released, not stale
            run_dir.close(started=started)


def _batch_mixing(cfg: Config, num_classes: int, log: RunLog) -> Optional[BatchMixing]:
    """--mixup-alpha and --cutmix-alpha's mixing (None without), said once with how training's top-1 is counted."""
    mixing = BatchMixing.of(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes)
    if mixing is not None:
        log.info(mixing.describe())
    return mixing


def _graphed_step(cfg: Config, ctx: Context, log: RunLog, model: nn.Module, criterion: nn.Module,
                  optimizer: Optimizer, policy, comm_hook: Optional[CommHook] = None) -> Optional[GraphedStep]:
    """--cuda-graphs: the training step to capture, or None (eager steps, or --evaluate's none); which, and
    why, said once. `comm_hook`: a DDP model's, whose stream (the one DDP was made on) the step is captured on."""
    if cfg.evaluate:
        return None
    choice = cuda_graphs.choose(cfg, ctx.device, model)
    if choice.note:
        log.info(choice.note)
    if not choice.capture:
        return None
    return GraphedStep(model, criterion, optimizer, policy, ctx.device, choice.warmup_steps, say=log.info,
                       stream=comm_hook.stream if comm_hook is not None else None)


def _describe_setup(log: RunLog, policy, loaders: Loaders, comm_hook: Optional[CommHook], cfg: Config) -> None:
    """The choices made for this run, said once at its start."""
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


def _start_run(plan: Plan, ctx: Context, log: RunLog, model: nn.Module, optimizer: Optimizer, policy,
               loaders: Loaders, start: ResumePoint, run_dir: Optional[RunDirectory], checkpoint_bytes: int) -> None:
    """The run's first lines and its config.json (every resolved value); a
    config.json that cannot be written (a full disk) ends every process alike."""
    cfg = plan.config
    accumulated = f" x {cfg.accum_steps} micro-batches" if cfg.accum_steps > 1 else ""
    log.info(f"global batch {plan.global_batch} ({cfg.batch_size} per replica{accumulated} x {ctx.replicas}); "
             f"lr {cfg.lr:g} x {plan.global_batch}/256 = {plan.lr:g}, {plan.schedule.describe()}")
    if plan.ema_decay is not None:
        log.info(describe_ema(cfg.model_ema_decay, plan.ema_decay, cfg.model_ema_steps, plan.global_batch, cfg.epochs,
                              cfg.warmup_epochs))
    resolved = {
        "global_batch": plan.global_batch, "lr": plan.lr, "precision": policy.name,
        "precision_warning": policy.warning, "channels_last": plan.channels_last,
        "num_classes": loaders.num_classes, "train_images": len(loaders.train.dataset),
        "val_images": len(loaders.val.dataset),
        "steps_per_epoch": loaders.train_steps(cfg.steps_per_epoch),
        "checkpoint_bytes": checkpoint_bytes,
        "model_ema_decay": plan.ema_decay,  # --model-ema's decay per update, adjusted; None: no average
        "jpeg_decoder": loaders.jpeg_decoder.to_dict() if loaders.jpeg_decoder is not None else None,
        "dali": loaders.dali.to_dict() if loaders.dali is not None else None,
    }
    failure = None
    try:
        log.start_run(cfg, start, resolved, run_dir)  # config.json: on the primary
    except UsageError as error:  # it could not be written (a full disk)
        failure = str(error)
    failure = broadcast_from_primary(failure, ctx)  # every process ends alike, none left waiting
    if failure is not None:
        raise UsageError(failure)

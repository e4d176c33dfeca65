"""The training loop's body, for every script: Trainer (a step, an epoch of
them, a validation pass), LossGuard (NaN/inf losses), seeding and the SGD
optimizer. common/fit.py runs the epochs, common/session.py assembles a run.

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
import itertools
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

from common import measure, preemption
from common.augment import BatchMixing
from common.checkpoint import Checkpointer, ResumePoint
from common.config import CropSizes
from common.cuda_graphs import GraphedStep
from common.data import BadImages, Loaders, derived_seed
from common.device_input import DeviceInput
from common.ema import ModelEMA
from common.loss_guard import LossGuard
from common.data_timeout import DataTimeout
from common.distributed import Context, broadcast_buffers_from_primary, spans_processes
from common.errors import one_line
from common.measure import StepTimer
from common.meters import ClassReport, EpochMetrics, MetricSums, MetricTotals, SplitTiming
from common.preemption import Decision, StopControl
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


# Normalisation layers, by module type, as torchvision's references' set_weight_decay finds them
# (SyncBatchNorm is a _BatchNorm; ConvNeXt's LayerNorm2d a LayerNorm).
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
               nn.LocalResponseNorm)


def sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float, loss_scaling: bool = False, *,
        nesterov: bool = False, norm_weight_decay: Optional[float] = None,
        bias_weight_decay: Optional[float] = None) -> torch.optim.SGD:
    """SGD with momentum and weight decay (per parameter_groups), in as few
    kernel launches as the parameters' device allows (sgd_implementation).
    The same arithmetic as the per-parameter loop, within floating-point
    rounding. `loss_scaling`: a GradScaler (fp16) may skip steps."""
    parameters = list(model.parameters())
    on_gpu = bool(parameters) and all(parameter.is_cuda for parameter in parameters)
    return torch.optim.SGD(parameter_groups(model, weight_decay, norm_weight_decay, bias_weight_decay), lr=lr,
                           momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                           **sgd_implementation(on_gpu, loss_scaling))


def parameter_groups(model: nn.Module, weight_decay: float, norm_weight_decay: Optional[float] = None,
                     bias_weight_decay: Optional[float] = None) -> list:
    """The model's parameters as SGD takes them: all in one group (the
    parameters themselves, as before these flags) unless --norm-weight-decay
    or --bias-weight-decay is given; then a group per kind that has any, in
    the order other, norm, bias, each named by its "group" key (which a
    resume compares): normalisation layers' weights and biases (NORM_LAYERS)
    when --norm-weight-decay is given, else the biases among the others."""
    if norm_weight_decay is None and bias_weight_decay is None:
        return list(model.parameters())
    decays = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    members = {kind: [] for kind in decays}
    seen = set()  # a parameter shared by two modules joins one group
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if norm_weight_decay is not None and isinstance(module, NORM_LAYERS):
                members["norm"].append(parameter)
            elif bias_weight_decay is not None and name == "bias":
                members["bias"].append(parameter)
            else:
                members["other"].append(parameter)
    return [{"params": params, "weight_decay": decays[kind], "group": kind}
            for kind, params in members.items() if params]


def sgd_implementation(on_gpu: bool, loss_scaling: bool) -> dict:
    """fused (one kernel for all parameters) on GPUs, foreach (a few
    multi-tensor kernels) elsewhere and under fp16 loss scaling: torch's fused
    SGD (2.11 to 2.15 at least) makes its momentum buffers uninitialised on its
    first step and leaves them so when the GradScaler skips that step for
    overflowing gradients (a later skipped step leaves them as they were), so
    the routine overflow of the first fp16 steps turns the weights to NaN one
    step later (tests/e2e/test_precision.py shows it). --cuda-graphs on makes
    them zeros first and then uses fused SGD (common.cuda_graphs)."""
    return {"fused": True} if on_gpu and not loss_scaling else {"foreach": True}


class StopRequested(Exception):
    """Unwinds from the training loop to fit() (common/fit.py) once the stop's
    checkpoint is written, or its write failed (`failure`: why, on the primary)."""

    def __init__(self, decision: Decision, path: Optional[Path], where: str, failure: Optional[str] = None):
        super().__init__(decision.signal_name)
        self.decision = decision
        self.path = path
        self.where = where  # "epoch E step S/N": where every process stopped
        self.failure = failure


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
    # The splits whose images above Pillow's decompression-bomb limit were counted and named: once a run each.
    large_images_noted: set = dataclasses.field(default_factory=set, init=False)
    profile_steps: int = 0  # --profile-steps: training steps profiled, once a run (measure.StepProfiler)
    profiled: bool = dataclasses.field(default=False, init=False)
    accum_steps: int = 1  # --accum-steps: micro-batches per optimizer step
    mixing: Optional[BatchMixing] = None  # --mixup-alpha, --cutmix-alpha: on each micro-batch
    crop_sizes: Optional[CropSizes] = None  # each epoch's training crop, the validation crop; None: not recorded
    val_flip: bool = False  # --val-flip: validation logits averaged over each image and its mirror image
    compile: bool = False  # --compile: a new input size is compiled for (said once per size)
    # Input sizes the model has met in this run, and the training crop said last (--progressive-resizing).
    _sizes_met: set = dataclasses.field(default_factory=set, init=False)
    _crop_said: Optional[int] = dataclasses.field(default=None, init=False)
    ema: Optional[ModelEMA] = None  # --model-ema: updated after optimizer steps, validated beside the model
    graphed: Optional[GraphedStep] = None  # --cuda-graphs on: the step over static buffers, replayed; None: eager
    # This process's bytes of each split of the epoch just run, from DATA's storage and from the node-local cache
    # ({split: (source, cache)}; a resumed epoch's: since the resume): io.csv's per-node "data" rows.
    read_bytes: dict = dataclasses.field(default_factory=dict, init=False)

    def __post_init__(self):
        self.guard = self.guard or LossGuard(self.ctx, self.max_nonfinite_steps)
        self._input = DeviceInput(self.ctx.device, self.channels_last)  # batches finished on the device

    def _should_print(self, step: int, steps: int) -> bool:
        return self.log.is_primary and ((step + 1) % self.print_freq == 0 or step + 1 == steps)

    def train_one_epoch(self, loaders: Loaders, epoch: int, start: Optional[ResumePoint] = None) -> "TrainedEpoch":
        """Train one epoch, or the rest of it after the mid-epoch checkpoint `start`."""
        self.model.train()
        images_done = start.images_done if start is not None else 0
        step_numbers = loaders.set_epoch(epoch, images_done, self.steps_per_epoch)
        steps, image_size = step_numbers.stop, self._input_size(epoch, "train")  # the epoch's crop, said when new
        before = _PartialEpoch.from_dict(start.partial_epoch if start is not None else None)
        sums = MetricSums(self.ctx.device)
        progress = self.log.progress_meter("train", epoch, steps, first_step=step_numbers.start)
        timer = StepTimer(len(step_numbers), self.warmup_steps, self.ctx.devices)
        bad_images = BadImages(loaders.train.dataset)
        batches = iter(self._input(loaders.batches("train"), loaders.dali))
        profiler = self._profiler(epoch, step_numbers.start)
        lr = None

        def checkpoint_at(step: int, stopping: bool) -> Tuple[Optional[Path], Optional[str]]:
            self.guard.settle()  # never a checkpoint of weights a non-finite loss has touched
            with timer.paused():
                partial = before.plus(_PartialEpoch.measure(sums, timer, self.ctx, bad_images))
                done = images_done + (step - step_numbers.start) * loaders.global_batch
                return self.save_mid_epoch(epoch, step, steps, done, partial, stopping)

        try:
            for step in step_numbers:
                with record_function("step:stop control"):
                    decision = self.control.step(epoch * steps + step)
                if decision.checkpoint or decision.stop:
                    path, failure = checkpoint_at(step, decision.stop)
                    if decision.stop:
                        raise StopRequested(decision, path, f"epoch {epoch} step {step}/{steps}", failure)
                try:
                    with record_function("step:data"):
                        batch = next(batches)
                except DataTimeout as stall:  # between steps: where a checkpoint can be written
                    raise self.stalled(stall, f"epoch {epoch} step {step}/{steps}",
                                       lambda: checkpoint_at(step, stopping=True)) from None
                timer.batch_ready()
                lr = self._step(batch, batches, epoch, step, steps, loaders.seed, sums, timer, bad_images)
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
        self.read_bytes["train"] = (sums.source_bytes, sums.cache_bytes)
        totals = before.totals.plus(sums.totals(self.ctx))  # summed over processes
        bad_files = _report_bad_images(self.log, self.ctx, epoch, "train", totals, bad_images, before.bad_files)
        self._note_large_images("train", epoch, totals, bad_images)
        timing = timer.finish(self.ctx, before.timing)
        lr = self.schedule.lr(epoch, steps - 1, steps) if lr is None and steps else lr  # None: all steps resumed
        metrics = EpochMetrics.from_totals(epoch, "train", totals, timing, self.ctx.replicas, lr, time.time(),
                                           self.precision.status(), image_size=image_size)
        return TrainedEpoch(metrics, steps, images_done + len(step_numbers) * loaders.global_batch,
                            _PartialEpoch(totals=totals, timing=timing, bad_files=bad_files))

    def _step(self, batch, batches, epoch: int, step: int, steps: int, data_seed: int, sums: MetricSums,
              timer: StepTimer, bad_images: BadImages) -> float:
        """One optimizer step over --accum-steps micro-batches (`batch` the
        first, the rest drawn from `batches`); its figures added to `sums`.
        Returns the step's learning rate."""
        with record_function("step:seed, lr, guard"):
            # Dropout (and any other randomness in the model) draws from a seed of this step: the same
            # in a run resumed here as in one that never stopped.
            seed_generators(derived_seed(data_seed, epoch, step, self.ctx.rank), self.ctx.devices)
            lr = self.schedule.lr(epoch, step, steps)
            set_lr(self.optimizer, lr)
            buffers = self.guard.buffers_before(self.model)
        if self.graphed is not None:
            return self._graphed_step(batch, epoch, step, steps, lr, sums, timer, bad_images)
        # --accum-steps N: the first N - 1 micro-batches add their gradients (each loss / N) without
        # DDP's exchange; the last one's backward exchanges the sum, then one optimizer step.
        if self.accum_steps > 1:
            self.optimizer.zero_grad(set_to_none=True)
        micro = []
        for index in range(self.accum_steps):
            if index:  # the step's later micro-batches: their wait is data wait too
                with record_function("step:data"):
                    try:
                        batch = timer.waiting(lambda: next(batches))
                    except DataTimeout as stall:  # BatchNorm has seen the earlier ones: no checkpoint here
                        raise self.stalled(stall, f"epoch {epoch} step {step}/{steps}", None) from None
            # A micro-batch's mixing draws from a seed of its position: a resume mixes alike.
            mix_seed = derived_seed(data_seed, epoch, step, self.ctx.rank, index) if self.mixing else 0
            micro.append(self._accumulated(batch, bad_images, backward=index < self.accum_steps - 1,
                                           mix_seed=mix_seed))
        loss = micro[0].loss if len(micro) == 1 else sum(part.loss for part in micro) / len(micro)
        if self.guard.allows_update(loss, epoch, step, lr):
            with record_function("step:backward and optimizer"):
                if len(micro) == 1:
                    self.precision.backward_and_step(micro[0].loss, self.optimizer)
                else:
                    self.precision.backward(micro[-1].loss / len(micro))
                    self.precision.step(self.optimizer)
            if self.ema is not None:  # after the whole step, from the weights it made (not a skipped one's)
                with record_function("step:model EMA"):
                    self.ema.update(self.model, epoch, step, steps, self.precision.last_step_skipped)
            with record_function("step:metric sums"):
                for part in micro:
                    sums.add(part.loss, part.logits, part.target, timed=timer.timing, **part.files)
        else:  # a tolerated non-finite loss: no update, no trace in the buffers or the epoch's figures
            self.guard.restore_buffers(self.model, buffers)
            self.log.info(f"warning: epoch {epoch} step {step}: the training loss is not finite; step skipped "
                          f"({self.guard.skipped} of --max-nonfinite-steps {self.guard.tolerance})")
            for part in micro:
                sums.add_files(**part.files)
        self.ctx.contact.heard(f"epoch {epoch} step {step + 1}/{steps} done")  # every process took part
        return lr

    def _graphed_step(self, batch, epoch: int, step: int, steps: int, lr: float, sums: MetricSums,
                      timer: StepTimer, bad_images: BadImages) -> float:
        """_step by common.cuda_graphs (one micro-batch, no mixing, no EMA,
        no tolerated NaN: what `graphed` is made for): the graph's replay, or
        the same step eagerly before its capture; the LossGuard's flags and
        the metric sums from its outputs, before the next replay rewrites them."""
        with record_function("step:cuda graph"):
            outputs = self.graphed(batch.image, batch.target, lr, f"epoch {epoch} step {step}")
        self.guard.flags_allow_update(outputs.flags, epoch, step, lr)
        with record_function("step:metric sums"):
            sums.add(outputs.loss, outputs.logits, batch.target, timed=timer.timing, **batch_reads(batch, bad_images))
        self.ctx.contact.heard(f"epoch {epoch} step {step + 1}/{steps} done")  # every process took part
        return lr

    def stalled(self, stall: DataTimeout, where: str,
                save: Optional[Callable[[], Tuple[Optional[Path], Optional[str]]]]) -> DataTimeout:
        """`stall` (a batch that did not come within --data-timeout), saying
        where (`where`) and what was saved: the checkpoint `save` writes, if
        this process trains alone and was between steps (`save` given). With
        peers none is: they wait for this process in a collective, where no
        checkpoint can be agreed on; it says so and ends (common.fit)."""
        if spans_processes(self.ctx):
            saved = "no checkpoint: the other processes wait for this one in a collective"
        elif save is None:
            saved = "no checkpoint: the step was part done (--accum-steps)"
        else:
            path, failure = save()
            saved = f"checkpoint saved to {path}" if path is not None else f"its checkpoint not written ({failure})"
        return DataTimeout(f"stopping at {where}: {stall}; {saved}; once the data reads again, continue with --resume")

    def save_mid_epoch(self, epoch: int, step: int, steps: int, images_done: int, partial: "_PartialEpoch",
                       stopping: bool) -> Tuple[Optional[Path], Optional[str]]:
        """A checkpoint at step `step` of `steps` (a periodic one, or a
        stop's): its path, or None and why it could not be written."""
        return saved_or_why(lambda: self.checkpointer.save_mid_epoch(
            epoch, step, images_done, partial.to_dict(), steps, stopping=stopping, log=self.log))

    def _accumulated(self, batch, bad_images: BadImages, backward: bool = False,
                     mix_seed: int = 0) -> "_MicroBatch":
        """One micro-batch's forward pass (and, for all but a step's last,
        `backward`, its backward pass without DDP's exchange, the loss divided
        by --accum-steps as the step's mean over them needs). Both under
        no_sync(): DDP arms its exchange for the backward during the forward.
        With mixing, the loss takes the mixed (probability) targets and the
        hit counts the label with the larger share, as torchvision's references count."""
        images, target, loss_target = batch.image, batch.target, batch.target
        if self.mixing is not None:
            with record_function("step:mixing"):
                images, loss_target = self.mixing(images, target, mix_seed)
                images = images.contiguous(memory_format=self._input.memory_format)
                target = loss_target.argmax(dim=1)
        with self._no_sync() if backward else contextlib.nullcontext():
            with record_function("step:forward"), self.precision.autocast():
                logits = self.model(images)
                loss = self.criterion(logits, loss_target)
            if backward:
                with record_function("step:backward (accumulating)"):
                    self.precision.backward(loss / self.accum_steps)
        return _MicroBatch(loss, logits, target, batch_reads(batch, bad_images))

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
    def validate(self, loaders: Loaders, epoch: int, averaged: bool = False,
                 predictions=None) -> Tuple[EpochMetrics, ClassReport]:
        """Loss, top-1/top-5 and the per-class report over the whole
        validation set, each image counted once whatever the number of
        processes (the confusion matrix is summed over them). `averaged`:
        of --model-ema's average (split "val_ema"), not of the model.
        `predictions` (--evaluate: common.evaluation.Predictions) gets each
        readable image's dataset index and logits."""
        model, split = self._validated_model(averaged), "val_ema" if averaged else "val"
        model.eval()
        val_size = self._input_size(epoch, "val")
        loader = loaders.val
        steps = len(loader)
        sums = MetricSums(self.ctx.device, loaders.num_classes)
        progress = self.log.progress_meter(split, epoch, steps)
        timer = StepTimer(loaders.primary_val_steps(), self.warmup_steps, self.ctx.devices)
        bad_images = BadImages(loader.dataset)
        order = iter(loader.sampler)  # the dataset indices of this process's batches, in turn (ShardSampler)
        for step, batch in enumerate(self._input(loaders.batches("val"), loaders.dali)):
            timer.batch_ready()
            images, target = batch.image, batch.target
            indices = torch.tensor(list(itertools.islice(order, len(target))), dtype=torch.int64)
            files = batch_reads(batch, bad_images)
            if files["bad_images"]:  # stand-ins for unreadable files: validation counts each readable image once
                readable = (batch.bad_index < 0).to(images.device)
                images, target, indices = images[readable], target[readable], indices[readable.cpu()]
            if len(target):
                with self.precision.autocast():
                    logits = model(images)
                    if self.val_flip:  # FFCV's test-time flip; loss and accuracy of the mean
                        logits = (logits + model(torch.flip(images, dims=[3]))) / 2
                    loss = self.criterion(logits, target)
                sums.add(loss, logits, target, timed=timer.timing, **files)
                if predictions is not None:
                    predictions.add(indices, logits)
            else:
                sums.add_files(**files)
            if self._should_print(step, steps):
                progress.show(step, sums.totals(), timer, None)
            timer.step_done()
        totals = sums.totals(self.ctx)
        self.read_bytes[split] = (sums.source_bytes, sums.cache_bytes)
        if not averaged:  # the same files again in the average's pass: said once
            _report_bad_images(self.log, self.ctx, epoch, "val", totals, bad_images)
            self._note_large_images("val", epoch, totals, bad_images)
        report = sums.class_report(self.ctx)
        self.ctx.contact.heard(f"epoch {epoch}'s validation{' of the model EMA' if averaged else ''} done")
        metrics = EpochMetrics.from_totals(epoch, split, totals, timer.finish(self.ctx), self.ctx.replicas, None,
                                           time.time(), macro_f1=report.macro_f1, image_size=val_size)
        return metrics, report

    def _input_size(self, epoch: int, split: str) -> Optional[int]:
        """The side of `split`'s crops in epoch `epoch` (None: not known, a
        Trainer used on its own), for its metrics row; under
        --progressive-resizing each new training crop is said once, and under
        --compile each size the compiled model meets for the first time."""
        if self.crop_sizes is None:
            return None
        size = self.crop_sizes.train(epoch) if split == "train" else self.crop_sizes.val
        new_to_compile = self.compile and bool(self._sizes_met) and size not in self._sizes_met
        self._sizes_met.add(size)
        compiling = " (--compile: compiled for this size, once)" if new_to_compile else ""
        if split == "train" and self.crop_sizes.progressive is not None and size != self._crop_said:
            self._crop_said = size
            self.log.info(f"epoch {epoch}: training crop {size} px{compiling}")
        elif compiling:
            self.log.info(f"epoch {epoch}: {'training' if split == 'train' else 'validation'} crop {size} px"
                          f"{compiling}")
        return size

    def _validated_model(self, averaged: bool) -> nn.Module:
        """What validate() runs: the model, or --model-ema's average, with the
        primary's buffers (each process's BatchNorm statistics are its own
        batches'; the primary's are the ones saved). DDP's own module: DDP adds
        nothing in evaluation, and processes may have one batch more or less
        than others here, which a collective inside DDP's forward would wait on
        forever. Under DataParallel the average is spread over the same GPUs."""
        model = self.model
        if averaged:  # the averaged copy of the plain model (not AveragedModel, whose count stays on the CPU)
            model = self.ema.module
            broadcast_buffers_from_primary(model, self.ctx)
            if isinstance(self.model, nn.DataParallel):
                model = nn.DataParallel(model, device_ids=self.model.device_ids, output_device=self.model.output_device)
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            broadcast_buffers_from_primary(model, self.ctx)
        return model


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


def saved_or_why(save: Callable[[], Optional[Path]]) -> Tuple[Optional[Path], Optional[str]]:
    """The path of the checkpoint `save` writes, or None and why it could not
    (a full disk). Only the primary writes, so only it can fail: where the
    run cannot go on without the file, fit() tells the others."""
    try:
        return save(), None
    except OSError as error:
        return None, one_line(error.strerror or str(error))


def batch_reads(batch, bad_images: BadImages) -> dict:
    """What reading a batch took (its bytes, and of them those from DATA's
    storage and from the node-local cache) and its unreadable and very large
    images: MetricSums.add's counts. (A batch made without the DataLoader's
    collate, as tests and the bench make them, has the sources as ints.)"""
    source_bytes, cache_bytes = (int(torch.as_tensor(count).sum()) for count in (batch.source_bytes, batch.cache_bytes))
    return dict(file_bytes=int(batch.file_bytes.sum()), source_bytes=source_bytes, cache_bytes=cache_bytes,
                bad_images=bad_images.count(batch), large_images=bad_images.count_large(batch))


@dataclasses.dataclass(frozen=True)
class TrainedEpoch:
    """What train_one_epoch returns: the epoch's metrics row, and where
    training stands at its end, for a stop that comes before validation ends
    (fit writes its checkpoint there)."""

    metrics: EpochMetrics
    steps: int  # the epoch's steps, all done
    images_done: int  # images of the epoch's order trained on, all processes together
    partial: "_PartialEpoch"  # the epoch's sums and timing


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

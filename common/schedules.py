"""Learning-rate schedules: the linear scaling rule, per-step warm-up
(linear or constant), and step, cosine or linear decay to a floor.

The rate is a pure function of (epoch, step within the epoch): nothing to
save or restore, so a resumed run gets exactly the rates of an uninterrupted
one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from torch.optim import Optimizer

from common.config import CONSTANT_WARMUP_DECAY, LR_SCHEDULES, WARMUP_METHODS
from common.errors import UsageError

REFERENCE_BATCH = 256  # --lr is the rate for this global batch (Goyal et al., 2017)


def scaled_lr(lr_per_256: float, global_batch: int) -> float:
    """The linear scaling rule: the rate grows in proportion to the global batch.
    A rate that overflows (--lr 1e308 on 512 images a step) would train on
    inf and NaN weights until the first checkpoint refused them."""
    lr = lr_per_256 * global_batch / REFERENCE_BATCH
    if not math.isfinite(lr):
        raise UsageError(f"argument --lr: {lr_per_256:g} scaled to the global batch of {global_batch} is {lr:g}, "
                         f"not a usable rate")
    return lr


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The rate at each step: peak_lr x the warm-up's factor x the decay's
    factor. The decay's factor runs from 1 down to min_lr / peak_lr (the
    floor), so the warm-up may start below the floor, as torchvision's does."""

    peak_lr: float  # the rate after warm-up, before any decay
    epochs: int
    kind: str = "step"  # step | cosine | linear (config.LR_SCHEDULES)
    milestones: Tuple[int, ...] = (30, 60, 80)  # step: epochs where the rate is multiplied by gamma
    gamma: float = 0.1
    warmup_epochs: float = 0.0
    warmup_method: str = "linear"  # linear | constant (config.WARMUP_METHODS)
    # The warm-up's factor at its first step: linear climbs from it to 1 (torchvision's LinearLR start_factor),
    # constant holds it (ConstantLR's factor). None: linear from 1/warm-up steps, constant CONSTANT_WARMUP_DECAY.
    warmup_decay: Optional[float] = None
    min_lr: float = 0.0  # the floor (scaled to the global batch): cosine's eta_min, step's lowest, linear's last

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown schedule kind {self.kind!r}")
        if self.warmup_method not in WARMUP_METHODS:
            raise ValueError(f"unknown warm-up method {self.warmup_method!r}")

    def lr(self, epoch: int, step: int, steps_per_epoch: int) -> float:
        """The rate for step `step` (0-based) of epoch `epoch` (0-based)."""
        progress = epoch + step / steps_per_epoch  # epochs completed before this step
        step_index = epoch * steps_per_epoch + step
        warmup_steps = round(self.warmup_epochs * steps_per_epoch)
        return (self.peak_lr * self._warmup_factor(step_index, warmup_steps)
                * self._decay_factor(epoch, progress, step_index, warmup_steps, self.epochs * steps_per_epoch))

    def _warmup_factor(self, step_index: int, warmup_steps: int) -> float:
        if step_index >= warmup_steps:
            return 1.0
        if self.warmup_method == "constant":
            return CONSTANT_WARMUP_DECAY if self.warmup_decay is None else self.warmup_decay
        if self.warmup_decay is None:  # from 1/warmup_steps at the first step to 1 at the last warm-up step
            return (step_index + 1) / warmup_steps
        # torchvision's LinearLR, per step: warmup_decay at the first step, 1 at the first step after warm-up.
        return self.warmup_decay + (1.0 - self.warmup_decay) * step_index / warmup_steps

    def _floor(self) -> float:
        return self.min_lr / self.peak_lr if self.peak_lr else 0.0

    def _decay_factor(self, epoch: int, progress: float, step_index: int, warmup_steps: int,
                      total_steps: int) -> float:
        floor = self._floor()
        if self.kind == "step":
            return max(self.gamma ** sum(1 for milestone in self.milestones if epoch >= milestone), floor)
        if self.kind == "linear":
            # FFCV's ramp down, per step: 1 at the first step after warm-up, the floor at the run's last step.
            span = total_steps - 1 - warmup_steps
            fraction = 1.0 if span <= 0 else min(max((step_index - warmup_steps) / span, 0.0), 1.0)
            return 1.0 + (floor - 1.0) * fraction
        # Cosine over the epochs after warm-up, from 1 at its start towards the floor at the last step.
        span = self.epochs - self.warmup_epochs
        if span <= 0:  # the whole run is warm-up: no decay starts
            return 1.0
        fraction = min(max((progress - self.warmup_epochs) / span, 0.0), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * fraction))

    def describe(self) -> str:
        """The schedule in words, for the run's first lines: 'cosine schedule to 0.002, linear warm-up ...'."""
        if self.kind == "step":
            text = (f"step schedule (x{self.gamma:g} at epoch {', '.join(map(str, self.milestones))}"
                    + (f", not below {self.min_lr:g})" if self.min_lr else ")"))
        elif self.kind == "cosine":
            text = f"cosine schedule to {self.min_lr:g} at the end of epoch {self.epochs - 1}"
        else:
            text = f"linear schedule from the peak after warm-up to {self.min_lr:g} at the last step"
        if not self.warmup_epochs:
            return text
        if self.warmup_method == "constant":
            start = f"at {CONSTANT_WARMUP_DECAY if self.warmup_decay is None else self.warmup_decay:g} x the rate"
        else:
            start = "from lr/warm-up steps" if self.warmup_decay is None else f"from {self.warmup_decay:g} x the rate"
        return f"{text}; {self.warmup_method} warm-up over {self.warmup_epochs:g} epoch(s), per step, {start}"


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

"""Learning-rate schedules: the linear scaling rule, per-step linear warm-up,
and step or cosine decay.

The rate is a pure function of (epoch, step within the epoch): nothing to
save or restore, so a resumed run gets exactly the rates of an uninterrupted
one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Tuple

from torch.optim import Optimizer

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
    peak_lr: float  # the rate after warm-up, before any decay
    epochs: int
    kind: str = "step"  # "step" or "cosine"
    milestones: Tuple[int, ...] = (30, 60, 80)  # step: epochs where the rate is multiplied by gamma
    gamma: float = 0.1
    warmup_epochs: float = 0.0

    def __post_init__(self):
        if self.kind not in ("step", "cosine"):
            raise ValueError(f"unknown schedule kind {self.kind!r}")

    def lr(self, epoch: int, step: int, steps_per_epoch: int) -> float:
        """The rate for step `step` (0-based) of epoch `epoch` (0-based)."""
        progress = epoch + step / steps_per_epoch  # epochs completed before this step
        return self.peak_lr * self._warmup_factor(epoch, step, steps_per_epoch) * self._decay_factor(epoch, progress)

    def _warmup_factor(self, epoch: int, step: int, steps_per_epoch: int) -> float:
        # Linear per step, from 1/warmup_steps at the first step to 1 at the last warm-up step.
        warmup_steps = round(self.warmup_epochs * steps_per_epoch)
        step_index = epoch * steps_per_epoch + step
        if step_index >= warmup_steps:
            return 1.0
        return (step_index + 1) / warmup_steps

    def _decay_factor(self, epoch: int, progress: float) -> float:
        if self.kind == "step":
            return self.gamma ** sum(1 for milestone in self.milestones if epoch >= milestone)
        # Cosine over the epochs after warm-up, from 1 at its start towards 0 at the last step.
        span = self.epochs - self.warmup_epochs
        if span <= 0:  # the whole run is warm-up: no decay starts
            return 1.0
        fraction = min(max((progress - self.warmup_epochs) / span, 0.0), 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * fraction))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

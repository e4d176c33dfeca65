"""--model-ema: an exponential moving average of the weights and buffers, kept
as torchvision's classification references keep it (references/classification
train.py and utils.ExponentialMovingAverage): torch.optim.swa_utils'
AveragedModel with get_ema_multi_avg_fn and use_buffers=True, updated every
--model-ema-steps optimizer steps, its decay adjusted for the images an
update interval spans and the run's length, and reset to the weights during
the learning rate's warm-up.

Updates are counted by the optimizer step's number over the run (epoch x
steps per epoch + step), not within each epoch as torchvision's loop counts
them: a function of the position only, so a run resumed from a mid-epoch
checkpoint (which holds the average and its count) updates at the same steps
as one that never stopped. docs/recipes.md ("Model EMA") says what was taken.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from common.models import unwrap


def adjusted_decay(decay: float, global_batch: int, every_steps: int, epochs: int) -> float:
    """torchvision's decay adjustment (after pycls): alpha = 1 - decay, scaled
    by the images one update interval spans per epoch of the run,
    alpha = min(1, alpha x global_batch x every_steps / epochs), and the
    decay applied per update is 1 - alpha. torchvision's `world_size x
    batch_size` is the images of one optimizer step, all processes: here the
    global batch, -b x --accum-steps x replicas."""
    alpha = min(1.0, (1.0 - decay) * global_batch * every_steps / epochs)
    return 1.0 - alpha


def describe(decay: float, applied: float, every_steps: int, global_batch: int, epochs: int,
             warmup_epochs: float) -> str:
    """The run's line: the decay asked for, the one applied, and why."""
    return (f"model EMA: updated every {every_steps} optimizer steps, decay {decay:g} adjusted to {applied:.8g} "
            f"(1 - min(1, (1 - {decay:g}) x global batch {global_batch} x {every_steps} steps / {epochs} epochs), "
            f"torchvision's rule)" + (f"; reset to the weights during the {warmup_epochs:g} warm-up epochs"
                                      if warmup_epochs else ""))


class ModelEMA:
    """The average of one model (the plain module inside any wrapper:
    models.unwrap), on the model's device and in its dtypes. Every process
    keeps one from its own model; the primary's buffers are the ones
    validated (engine.Trainer.validate) and saved."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int, warmup_epochs: float = 0.0):
        self.decay = decay  # applied per update: adjusted_decay's
        self.every_steps = every_steps
        self.warmup_epochs = warmup_epochs
        self.averaged = AveragedModel(unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        for parameter in self.averaged.parameters():  # averaged, never trained: no gradients to keep
            parameter.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        """The averaged model, to validate."""
        return self.averaged.module

    @property
    def n_averaged(self) -> int:
        """Updates since the average last started from the weights (0: the next update copies them)."""
        return int(self.averaged.n_averaged.item())

    def due(self, epoch: int, step: int, steps: int) -> bool:
        """Whether step `step` of `steps` in epoch `epoch` (0-based) updates the
        average: every `every_steps` steps counted over the run, from its first."""
        return (epoch * steps + step) % self.every_steps == 0

    def in_warmup(self, epoch: int, step: int, steps: int) -> bool:
        """Whether the step is in the learning rate's warm-up (the steps
        before round(--warmup-epochs x steps), as common.schedules counts
        them): torchvision's `epoch < lr_warmup_epochs`, which whole warm-up
        epochs give as well."""
        return epoch * steps + step < round(self.warmup_epochs * steps)

    def update(self, model: nn.Module, epoch: int, step: int, steps: int,
               skipped: Callable[[], bool] = lambda: False) -> bool:
        """After the optimizer step `step` of epoch `epoch`: update the
        average from `model` when the step is due and was not skipped
        (`skipped`, asked only then: fp16's scaler may have skipped it, which
        a host read tells); in warm-up, the count is reset, so the next
        update copies the weights again (torchvision's rule). Whether it updated."""
        if not self.due(epoch, step, steps) or skipped():
            return False
        self.averaged.update_parameters(unwrap(model))
        if self.in_warmup(epoch, step, steps):
            self.averaged.n_averaged.fill_(0)
        return True

    def start_from(self, model: nn.Module) -> None:
        """Restart the average from `model`'s weights and buffers (a resume
        from a checkpoint that holds none): the next update copies them again."""
        with torch.no_grad():
            for mine, theirs in zip(self._tensors(self.averaged.module), self._tensors(unwrap(model))):
                mine.copy_(theirs)
        self.averaged.n_averaged.fill_(0)

    @staticmethod
    def _tensors(module: nn.Module):
        return [*module.parameters(), *module.buffers()]

    def state_dict(self) -> dict:
        """For checkpoints: the averaged weights and buffers (the plain
        model's names), the update count and how it was made."""
        return {"state_dict": self.averaged.module.state_dict(), "n_averaged": self.n_averaged,
                "decay": self.decay, "every_steps": self.every_steps}

    def load_state_dict(self, state: dict, load_weights: Callable[[nn.Module, dict], None]) -> None:
        """Restore state_dict()'s; `load_weights(module, state_dict)` loads the
        weights (common.checkpoint's, which takes wrappers' names into account)."""
        load_weights(self.averaged.module, state["state_dict"])
        self.averaged.n_averaged.fill_(int(state.get("n_averaged", 0)))

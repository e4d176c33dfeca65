"""LossGuard: a NaN or inf training loss on any process, seen by every
process alike (its flag summed over them), without making the device wait
for the host; NonFiniteLoss, what it raises, which common/fit.py turns into
the run's end (exit status 3, the last good checkpoint kept). Used by
common.engine.Trainer each step and before every checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from common.distributed import Context, all_reduce_sum, all_reduce_sum_started


class NonFiniteLoss(Exception):
    """Unwinds from the training loop to fit() (common/fit.py): the message says where."""


def nonfinite_flags(loss: torch.Tensor) -> torch.Tensor:
    """[1 if the loss is NaN, 1 if it is inf] on the loss's device, made
    without the host (so a captured step can make them): LossGuard sums them
    over the processes."""
    loss = loss.detach().float()
    return torch.stack([loss.isnan(), loss.isinf()]).to(torch.float32)


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
        Raises NonFiniteLoss for a bad step that is not tolerated (this one's
        with a tolerance, else the previous one's)."""
        return self.flags_allow_update(nonfinite_flags(loss), epoch, step, lr)

    def flags_allow_update(self, flags: torch.Tensor, epoch: int, step: int, lr: float) -> bool:
        """allows_update, given the step's nonfinite_flags (a CUDA graph's
        output, common.cuda_graphs: summed over the processes in place)."""
        if not flags.is_cuda:  # read a step later: a copy, as the device's below (a replay rewrites its outputs)
            flags = flags.clone()
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
            raise NonFiniteLoss(f"{problem}, more than --max-nonfinite-steps {self.tolerance}")
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
            raise NonFiniteLoss(f"{where}: {int(bad.item())} weight or buffer tensor(s) are not finite on some "
                             f"process, although the losses were")

    def settle(self) -> None:
        """Check the step not yet checked (before a checkpoint, and at an epoch's end)."""
        checked, self._pending = self._pending, None
        self._raise_if_bad(checked)

    def _raise_if_bad(self, checked) -> None:
        problem = self._problem(checked)
        if problem is not None:
            raise NonFiniteLoss(problem)

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

"""Precision policies: how the loop runs the forward pass and applies a step.

The engine only calls `policy.autocast()` around the forward pass,
`policy.backward_and_step(loss, optimizer)` (or, over --accum-steps
micro-batches, `backward` each and one `step`: where --clip-grad-norm
clips the final gradients) and, at print intervals and
epoch ends, `policy.status()`; a policy's state (the loss scaler's) travels
in the checkpoint through `state_dict()` / `load_state_dict()`.

`FP32` is plain single precision, the reference every faster policy is
compared against. `MixedPrecision` implements NVIDIA Apex's opt levels with
native PyTorch AMP (torch.autocast and torch.amp.GradScaler), no Apex needed:

  O0  fp32: the FP32 policy itself.
  O1  autocast: ops on PyTorch's autocast lists (convolutions, matmuls) run in
      fp16/bf16, the rest in fp32; weights, gradients and the optimizer stay
      fp32; fp16 gets dynamic loss scaling.
  O2  O1 plus channels-last memory format on GPUs (tensor cores want NHWC):
      the fastest setting that keeps fp32 master weights and fp32 BatchNorm.
  O3  the whole model cast to fp16/bf16 (BatchNorm too, unless
      --keep-batchnorm-fp32 True), no fp32 master weights and so no loss
      scaling (GradScaler cannot unscale half gradients): a speed baseline
      that may diverge.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from common import hardware
from common.errors import UsageError

OPT_LEVELS = ("O0", "O1", "O2", "O3")
AUTO = "auto"  # --opt-level's default: the fastest level that is native on the device (build_policy)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NEVER_GROW = 10**9  # growth interval (steps) of a static --loss-scale: it only halves on overflow


class FP32:
    """Plain fp32: no autocast, no loss scaling (Apex opt level O0)."""

    name = "fp32"
    opt_level = "O0"
    dtype_name = None  # no half type
    channels_last = False  # FP32 leaves the memory format to --channels-last
    scales_loss = False  # no GradScaler that could skip a step
    chosen_because: Optional[str] = None  # --opt-level auto: why this level (said by describe())
    warning: Optional[str] = None  # one line for the start of the run: a half type this device emulates

    def __init__(self, clip_grad_norm: Optional[float] = None):
        self.clip_grad_norm = clip_grad_norm  # --clip-grad-norm: the gradients' largest L2 norm; None: no clipping

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward_and_step(self, loss: torch.Tensor, optimizer: Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.backward(loss)
        self.step(optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        """Add the loss's gradients to the parameters' (--accum-steps calls it per micro-batch)."""
        loss.backward()

    def step(self, optimizer: Optimizer) -> None:
        """The optimizer step on the gradients backward() added up."""
        self.clip(optimizer)
        optimizer.step()

    def clip(self, optimizer: Optimizer) -> None:
        """--clip-grad-norm: the gradients of all the optimizer's parameters
        scaled together down to that norm when above it, once they are final
        (DDP's exchange is done in the last backward, the micro-batches are
        summed, fp16's are unscaled). A non-finite norm (an overflowing
        gradient) turns them NaN: fp16's scaler skips that step as it would
        have (unscale_ noted the overflow); in fp32 the step would have spoilt
        the weights anyway, which the check before every checkpoint reports."""
        if self.clip_grad_norm is not None:
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)

    def forget_step(self, optimizer: Optimizer) -> None:
        """A step of `optimizer` begun and never applied (a CUDA-graph capture that failed: common.cuda_graphs):
        none of it kept."""

    def last_step_skipped(self) -> bool:
        """Whether the last step() left the weights as they were (fp16's scaler skips overflowing steps)."""
        return False

    def status(self) -> dict:
        """Loss scale and skipped steps, for progress lines and logs (none in fp32)."""
        return {}

    def describe(self) -> str:
        return "precision: fp32" + self._chosen() + self._clipping()

    def _chosen(self) -> str:
        return f" (--opt-level auto: {self.chosen_because})" if self.chosen_because else ""

    def _clipping(self) -> str:
        return f"; gradients clipped to norm {self.clip_grad_norm:g}" if self.clip_grad_norm is not None else ""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class MixedPrecision(FP32):
    """Apex opt levels O1-O3 with torch.autocast and torch.amp.GradScaler."""

    def __init__(self, opt_level: str, dtype: torch.dtype, device: torch.device,
                 keep_batchnorm_fp32: Optional[bool] = None, loss_scale: Union[str, float, None] = None,
                 clip_grad_norm: Optional[float] = None):
        super().__init__(clip_grad_norm)
        self.opt_level = opt_level
        self.dtype = dtype
        self.dtype_name = "fp16" if dtype == torch.float16 else "bf16"
        self.device_type = device.type
        self.name = f"{opt_level} {self.dtype_name}"
        self.channels_last = opt_level in ("O2", "O3") and device.type == "cuda"
        # Apex's defaults: BatchNorm stays fp32 except in O3, where it follows the model.
        self.keep_batchnorm_fp32 = opt_level != "O3" if keep_batchnorm_fp32 is None else keep_batchnorm_fp32
        if loss_scale is None:  # Apex's defaults
            loss_scale = 1.0 if opt_level == "O3" else "dynamic"
        scaling = dtype == torch.float16 and loss_scale != 1.0  # bf16 has fp32's range: nothing to scale
        dynamic = loss_scale == "dynamic"
        self.scaler = torch.amp.GradScaler(
            self.device_type, enabled=scaling,
            init_scale=2.0**16 if dynamic or not scaling else float(loss_scale),
            growth_interval=2000 if dynamic else NEVER_GROW,
        )
        self.scales_loss = self.scaler.is_enabled()
        self.skipped_steps = 0  # optimizer steps skipped for overflowing gradients, since the run began
        self.skipped_before_resume = 0
        self._skipped_now = None  # the same count, on the device, since status() last read it
        self._last_skipped = None  # whether the last step was skipped, on the device (last_step_skipped)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """O3: cast the model to the half type (BatchNorm as --keep-batchnorm-fp32
        says) and its inputs with it; the other levels keep fp32 weights."""
        if self.opt_level != "O3":
            return model
        model.to(self.dtype)
        if self.keep_batchnorm_fp32:
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.float()
        dtype = self.dtype
        model.register_forward_pre_hook(lambda module, args: tuple(
            arg.to(dtype) if torch.is_tensor(arg) and arg.is_floating_point() else arg for arg in args))
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.opt_level == "O3":
            return contextlib.nullcontext()  # the weights are already half: nothing to cast per op
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the scaled loss (the scaler creates its scale tensor on the first call)."""
        (self.scaler.scale(loss) if self.scaler.is_enabled() else loss).backward()

    def step(self, optimizer: Optimizer) -> None:
        """The step on the scaled gradients. An overflowing step is skipped by
        the scaler (the same on every process: DDP has averaged the gradients
        already) and halves the scale; the skip is counted on the device,
        without a host sync. --clip-grad-norm clips the unscaled gradients;
        the scaler still skips a step whose gradients overflowed (unscale_
        noted it), whatever clipping made of them."""
        if not self.scaler.is_enabled():
            super().step(optimizer)
            return
        scale_before = self.scaler._scale.clone()  # private, but reading it avoids a host sync per step
        if self.clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
            self.clip(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = (self.scaler._scale < scale_before).to(torch.int64)
        if self._skipped_now is None:  # made once and then written in place: a CUDA graph's replays write them too
            self._skipped_now, self._last_skipped = torch.zeros_like(skipped), torch.zeros_like(skipped)
        self._skipped_now.add_(skipped)
        self._last_skipped.copy_(skipped)

    def forget_step(self, optimizer: Optimizer) -> None:
        """The scaler's record of a step begun and never applied (unscaled, inf-checked): cleared, so the next
        step's unscale_ and step start afresh (GradScaler has no public call for it; update() clears it so).
        And what GradScaler.step hands a fused optimizer (torch 2.14's amp/grad_scaler.py): it sets
        optimizer.grad_scale and found_inf before optimizer.step and deletes them only once that returns, so a
        step that failed inside leaves them; the next step's scale would be multiplied by the stale one, its
        gradients unscaled twice. (After --clip-grad-norm's unscale_, the scale it hands is None.)"""
        self.scaler._per_optimizer_states.clear()
        for handed in ("grad_scale", "found_inf"):
            if hasattr(optimizer, handed):
                delattr(optimizer, handed)

    def last_step_skipped(self) -> bool:
        """Whether the scaler skipped the last step: a host read of a device
        flag, so asked only where it matters (--model-ema's update steps)."""
        return self._last_skipped is not None and bool(self._last_skipped.item())

    def _collect(self) -> None:
        if self._skipped_now is not None:
            self.skipped_steps += int(self._skipped_now.item())
            self._skipped_now.zero_()

    def status(self) -> dict:
        if not self.scaler.is_enabled():
            return {}
        self._collect()
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped_steps,
                "skipped_since_start": self.skipped_steps - self.skipped_before_resume}

    def describe(self) -> str:
        parts = [f"precision: Apex opt level {self.opt_level} with native AMP, {self.dtype_name}{self._chosen()}"]
        if self.opt_level == "O3":
            parts.append(f"whole model in half precision (BatchNorm in {'fp32' if self.keep_batchnorm_fp32 else 'half'})"
                         ", no fp32 master weights: a speed baseline that may diverge")
        else:
            parts.append("autocast, fp32 weights and BatchNorm" + (", channels-last" if self.channels_last else ""))
        if self.scaler.is_enabled():
            growth = "dynamic" if self.scaler.get_growth_interval() < NEVER_GROW else "static (halves on overflow)"
            parts.append(f"loss scale {self.scaler.get_scale():g}, {growth}")
        else:
            parts.append("no loss scaling")
        return "; ".join(parts) + self._clipping()

    def state_dict(self) -> dict:
        self._collect()
        return {"opt_level": self.opt_level, "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = self.skipped_before_resume = int(state.get("skipped_steps", 0))


def build_policy(opt_level: str, amp_dtype: Optional[str], device: torch.device,
                 keep_batchnorm_fp32: Optional[bool] = None, loss_scale: Union[str, float, None] = None,
                 support: Optional[hardware.HalfSupport] = None, clip_grad_norm: Optional[float] = None):
    """The policy of --opt-level. --amp-dtype defaults to fp16 on CUDA GPUs
    and bf16 on the CPU (where fp16 autocast is many times slower than fp32).
    `auto` takes the fastest level that is native here: O2 on a GPU with
    fast fp16 (or bf16, if asked), O1 on a CPU with native bf16 (O2 adds
    nothing there: channels-last is already the CPU's default), else O0. An
    explicit O1-O3 in a half type this device emulates still runs, with a
    warning. `support`: the device's (common.hardware), asked when not given.
    `clip_grad_norm`: --clip-grad-norm, whatever the level."""
    support = support or hardware.half_support(device)
    dtype_name = amp_dtype or ("fp16" if device.type == "cuda" else "bf16")
    chosen_because = None
    if opt_level == AUTO:
        if support.native(dtype_name):
            opt_level = "O2" if device.type == "cuda" else "O1"
            chosen_because = f"{dtype_name} is native on this {support.where} ({support.capability})"
        else:
            opt_level = "O0"
            chosen_because = (f"{dtype_name} is emulated on this {support.where} ({support.capability}), slower "
                              f"than fp32; --opt-level O1 would use it anyway")
    if opt_level == "O0":
        policy = FP32(clip_grad_norm)
        policy.chosen_because = chosen_because
        return policy
    # Compute capability 8 (Ampere) brought bf16 tensor cores; older GPUs would emulate it, slowly.
    if dtype_name == "bf16" and device.type == "cuda" and not support.bf16_native:
        raise UsageError(f"argument --amp-dtype: {torch.cuda.get_device_name(device)} has no bf16 support; use fp16")
    if keep_batchnorm_fp32 is False and opt_level in ("O1", "O2"):
        raise UsageError(f"argument --keep-batchnorm-fp32: {opt_level} keeps fp32 weights, BatchNorm included; "
                         f"False is for O3")
    if opt_level == "O3" and dtype_name == "fp16" and loss_scale not in (None, 1.0):
        raise UsageError("argument --loss-scale: O3 keeps no fp32 master weights to unscale gradients into; "
                         "it trains unscaled (use O1 or O2 for loss scaling)")
    policy = MixedPrecision(opt_level, DTYPES[dtype_name], device, keep_batchnorm_fp32, loss_scale, clip_grad_norm)
    policy.chosen_because = chosen_because
    policy.warning = support.emulation_warning(dtype_name, opt_level)
    return policy

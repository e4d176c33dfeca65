"""Precision policies: how the loop runs the forward pass and applies a step.

The engine only calls `policy.autocast()` around the forward pass and
`policy.backward_and_step(loss, optimizer)`; a policy's state (a loss
scaler's, for mixed precision) travels in the checkpoint through
`state_dict()` / `load_state_dict()`. `FP32` is plain single precision, the
reference every faster policy is compared against.
"""
from __future__ import annotations

import contextlib

import torch
from torch.optim import Optimizer


class FP32:
    """Plain fp32: no autocast, no loss scaling (Apex opt level O0)."""

    name = "fp32"
    opt_level = "O0"

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward_and_step(self, loss: torch.Tensor, optimizer: Optimizer) -> bool:
        """Back-propagate and update; returns whether the step was applied
        (always, in fp32; a loss scaler may skip steps that overflow)."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

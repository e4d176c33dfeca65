"""Who am I: rank, local rank, world size and device, in one place.

Every script gets a `Context` from here and passes it on; nothing else
decides the device or asks how many processes there are. One process
(imagenet_nd.py, imagenet_dp.py) is a world of size 1, so code written for
the distributed case runs unchanged there: reductions are no-ops.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from common.cli import UsageError


@dataclasses.dataclass(frozen=True)
class Context:
    rank: int  # global rank of this process
    local_rank: int  # rank among the processes of this node
    world_size: int  # number of training processes in the job
    device: torch.device
    backend: Optional[str] = None  # process-group backend (nccl / gloo); None without one

    @property
    def is_primary(self) -> bool:
        """Only the primary process prints, logs and writes files."""
        return self.rank == 0

    @property
    def device_kind(self) -> str:
        """'gpu' or 'cpu': the word used in run names (gpux8, cpux2)."""
        return "gpu" if self.device.type == "cuda" else "cpu"

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"


def select_device(choice: str, local_rank: int = 0) -> torch.device:
    """--device auto|cuda|cpu: auto takes the GPU of this local rank when CUDA sees one."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if choice == "cuda":
        raise UsageError("argument --device: cuda was asked for but no CUDA GPU is visible")
    return torch.device("cpu")


def single_process(device_choice: str = "auto") -> Context:
    """The context of a script that runs as one process on one device."""
    device = select_device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Input sizes are fixed, so cuDNN's per-shape autotuning pays for itself after a few steps.
        torch.backends.cudnn.benchmark = True
    return Context(rank=0, local_rank=0, world_size=1, device=device)


def all_reduce_sum(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Sum `tensor` over all processes, in place; returns it. Metrics cross
    processes only as sums and counts, never as averages of averages."""
    if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor

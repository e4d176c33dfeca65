"""Who am I: rank, local rank, world size and device, and the collectives.

Every script gets a `Context` (from single_process, data_parallel, or, for
DDP, common.spawn, which starts the processes, and common.rendezvous, where
each joins the group) and passes it on; nothing else decides the device or
asks how many processes there are. One process (imagenet_nd.py,
imagenet_dp.py) is a world of size 1, so code written for the distributed
case runs unchanged there: reductions are no-ops. Metrics cross processes
as sums and counts, never as averages of averages.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, TypeVar

import torch
import torch.distributed as dist

from common.errors import UsageError

T = TypeVar("T")


class LastContact:
    """When this process last finished a piece of work every process took
    part in (a training step, a validation pass; joining the group at first),
    and which: what a process that loses a peer says it last heard from it
    (common.spawn). Written by the training loop, read only then."""

    def __init__(self, what: str = "the process group joined"):
        self.heard(what)

    def heard(self, what: str) -> None:
        self.what, self.seconds = what, time.time()

    def describe(self) -> str:
        """'at 14:32:07 (epoch 3 step 120/5004 done)', in local time."""
        return f"at {time.strftime('%H:%M:%S', time.localtime(self.seconds))} ({self.what})"


@dataclasses.dataclass(frozen=True)
class Context:
    """Where this process stands in the job, and the device it computes on."""

    rank: int  # global rank of this process
    local_rank: int  # rank among the processes of this node
    world_size: int  # number of training processes in the job
    device: torch.device
    backend: Optional[str] = None  # process-group backend (nccl / gloo); None without one
    replicas_per_process: int = 1  # model replicas one process drives: its GPUs under nn.DataParallel
    launcher: str = "single process"  # how the processes were started, for config.json
    procs_per_node: int = 1  # training processes on this node: what shares its cores
    # A gloo group for the small host-side decisions (common.preemption): with NCCL they would
    # otherwise need a GPU tensor and a device sync. None: the default group.
    control_group: Optional[object] = dataclasses.field(default=None, compare=False, repr=False)
    # The launcher's own channel for each epoch's metrics (Ray Train's report, which Ray Tune and the
    # dashboard read), called by every process with the same figures; None under other launchers.
    launcher_report: Optional[Callable[[dict], None]] = dataclasses.field(default=None, compare=False, repr=False)
    # The last work done with every process (its time and what it was), for the line of a process that loses one.
    contact: LastContact = dataclasses.field(default_factory=LastContact, compare=False, repr=False)

    @property
    def is_primary(self) -> bool:
        """Only the primary process prints, logs and writes files."""
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Model replicas in the job (GPUs, or CPU processes): the global batch is -b times this."""
        return self.world_size * self.replicas_per_process

    @property
    def device_kind(self) -> str:
        """'gpu' or 'cpu': the word used in run names (gpux8, cpux2)."""
        return "gpu" if self.device.type == "cuda" else "cpu"

    @property
    def devices(self) -> List[torch.device]:
        """Every device this process computes on: its GPU, the GPUs it drives
        under nn.DataParallel (cuda:0 first, as DataParallel numbers them), or the CPU."""
        if self.device.type != "cuda" or self.replicas_per_process == 1:
            return [self.device]
        return [torch.device("cuda", index) for index in range(self.replicas_per_process)]

    def device_name(self) -> str:
        if self.device.type != "cuda":
            return "cpu"
        name = torch.cuda.get_device_name(self.device)
        return f"{self.replicas_per_process} x {name}" if self.replicas_per_process > 1 else name


def select_device(choice: str, local_rank: int = 0) -> torch.device:
    """--device auto|cuda|cpu: auto takes the GPU of this local rank when CUDA sees one."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if choice == "cuda":
        raise UsageError("argument --device: cuda was asked for but no CUDA GPU is visible")
    return torch.device("cpu")


def use_device(device: torch.device) -> None:
    """Make `device` this process's own, with the settings that make it fast."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Input sizes are fixed, so cuDNN's per-shape autotuning pays for itself after a few steps.
        torch.backends.cudnn.benchmark = True
        # TF32 tensor cores for fp32 matrix products too (PyTorch already allows them in cuDNN's
        # convolutions): ResNets' one linear layer, and any transformer --arch.
        torch.backends.cuda.matmul.allow_tf32 = True


def single_process(device_choice: str = "auto") -> Context:
    """The context of a script that runs as one process on one device."""
    device = select_device(device_choice)
    use_device(device)
    return Context(rank=0, local_rank=0, world_size=1, device=device)


def data_parallel(device_choice: str = "auto") -> Context:
    """One process driving every visible GPU through nn.DataParallel (its
    batches go to cuda:0 and are split from there); one replica on the CPU."""
    device = select_device(device_choice)
    use_device(device)
    replicas = torch.cuda.device_count() if device.type == "cuda" else 1
    return Context(rank=0, local_rank=0, world_size=1, device=device, replicas_per_process=replicas,
                   launcher="nn.DataParallel")


def spans_processes(ctx: Context) -> bool:
    """Whether `ctx` has peers to exchange with: the condition of every
    collective here (one process, or no process group, needs none)."""
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Sum `tensor` over all processes, in place; returns it. Metrics cross
    processes only as sums and counts, never as averages of averages."""
    if spans_processes(ctx):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_sum_started(tensor: torch.Tensor, ctx: Context) -> Optional[object]:
    """Start summing `tensor` over all processes, in place, without waiting:
    returns the operation to wait() on before reading it (None when there is
    nothing to wait for)."""
    if spans_processes(ctx):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return None


def all_reduce_max(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Maximum of `tensor` over all processes, in place (peaks, not totals)."""
    if spans_processes(ctx):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def gather_to_primary(value, ctx: Context) -> list:
    """Every process's `value` (a picklable object), in rank order, on the
    primary; an empty list on the others. A collective: all must call it."""
    if not spans_processes(ctx):
        return [value]
    gathered = [None] * ctx.world_size if ctx.is_primary else None
    dist.gather_object(value, gathered, dst=0)
    return gathered if ctx.is_primary else []


def gather_to_all(value, ctx: Context, group=None) -> list:
    """Every process's `value` (a picklable object), in rank order, on every
    process; `group`: the process group to send it over (the default one
    unless given). A collective: all must call it. It waits for the others
    within the group's timeout (--dist-timeout), then raises as any
    collective does."""
    if not spans_processes(ctx):
        return [value]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def broadcast_from_primary(value, ctx: Context):
    """The primary process's `value` (any picklable object), on every process:
    how one process's decision (say, a run directory it could not create)
    becomes everyone's, instead of leaving the others waiting."""
    if spans_processes(ctx):
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
    return value


def decided_by_primary(decide: Callable[[], T], ctx: Context) -> T:
    """What decide() returns on the primary, on every process: one process
    reads shared state (the checkpoint to resume, a dataset's file lists)
    and the others take its answer. A UsageError it raises is raised on
    every process, so none is left waiting. Without a process group every
    process decides for itself."""
    value, error = None, None
    if ctx.is_primary or not spans_processes(ctx):
        try:
            value = decide()
        except UsageError as raised:
            error = str(raised)
    value, error = broadcast_from_primary((value, error), ctx)
    if error is not None:
        raise UsageError(error)
    return value


def broadcast_buffers_from_primary(module: torch.nn.Module, ctx: Context) -> None:
    """Give every process the primary's buffers (BatchNorm running statistics).
    In training each process updates them from its own share of the batch, so
    they differ after the last step; the primary's are the ones checkpoints
    save, so they are the ones to validate with."""
    if spans_processes(ctx):
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

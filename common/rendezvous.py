"""Joining the process group: each training process meets its peers here
and gets its common.distributed.Context (rank, device, backend). A process
that cannot meet them says why in one line (RendezvousError): what c10d
writes to stderr meanwhile (every failed attempt, with a C++ stack) is held
back, and the lines of it that say why are quoted. Once joined, the check
that no two ranks compute on one GPU (check_gpu_binding: a missing
--gpus-per-task, a wrong CUDA_VISIBLE_DEVICES), in one line before NCCL
fails on it. And, when a collective timed out, the roll call over the
group's store that tells which ranks stopped answering (roll_call).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import socket
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import Context, gather_to_all, select_device, spans_processes, use_device
from common.errors import UsageError, error_summary
from common.launcher import Launch, cpu_threads_per_process, gpu_of_its_own


@contextlib.contextmanager
def _stderr_held_back():
    """Hold back what C++ code writes to stderr (file descriptor 2) meanwhile:
    c10d logs every failed connection attempt with a stack trace, which our
    one-line error replaces. Yields (replay, held): replay() passes it on after
    all; held() is what it holds so far, for the error to quote what says why."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as holder:
        os.dup2(holder.fileno(), 2)

        def held() -> bytes:
            holder.seek(0)
            return holder.read()

        def replay() -> None:
            os.dup2(saved, 2)
            os.write(2, held())

        try:
            yield replay, held
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# A line c10d logs (glog's format): "[W1125 14:32:37.461928954 TCPStore.cpp:340] [c10d] The client socket ...",
# before PyTorch 2.4 "[W socket.cpp:601] [c10d] ..."; I(nfo), W(arning), E(rror) or F(atal) first. Stack frames
# and "Exception raised from ..." lines are not.
_GLOG_LINE = re.compile(r"^\[([IWEF])(?:\d{4} [\d:.]+)? [^\]]*\] (?:\[c10d[^\]]*\] )?(.*\S)\s*$")
# What says why a connection failed: the system's error (errno 111 "Connection refused", 113 "No route to host",
# 98 "Address already in use") or name resolution's ("gai error: -2 - Name or service not known").
_CAUSE = re.compile(r"errno|gai error")
JOIN_LOG_LINES = 3  # at most this many lines of c10d's log go into a failed join's one-line error


def join_log_causes(log: str, summary: str) -> list:
    """The lines of c10d's log, held back while joining, that add to the
    exception's `summary`: its warnings and errors, and lines at any level that
    quote an errno (with TORCH_CPP_LOG_LEVEL=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL,
    "Connection refused"); each message once (retries differ in numbers only),
    none the summary already says, those with an errno first. Without glog's
    prefix, 200 characters each."""
    found: dict = {}
    for line in log.splitlines():
        match = _GLOG_LINE.match(line)
        if not match:
            continue
        level, text = match.groups()
        if (level == "I" and not _CAUSE.search(text)) or text in summary or summary in text:
            continue
        found.setdefault(re.sub(r"\d+", "#", text), text)
    causes = sorted(found.values(), key=lambda text: _CAUSE.search(text) is None)  # stable: log order otherwise
    return [text[:200] for text in causes[:JOIN_LOG_LINES]]


def _join_failure(cfg: Config, launch: Launch, error: BaseException, log: bytes) -> str:
    """The one line for a process that could not join: the exception, what c10d
    logged about it meanwhile, and what to check."""
    summary = error_summary(error)
    causes = join_log_causes(log.decode(errors="replace"), summary)
    said = summary
    if causes:
        said = f"{summary.rstrip('.')}; c10d logged: {'; '.join(cause.rstrip('.') for cause in causes)}"
    if "address already in use" in said.lower():
        # Fails at once, not after --dist-timeout: the address is right, another program holds the port.
        flag = {"torchrun": "torchrun's --master-port or --rdzv-endpoint",
                "torch.distributed.launch": "--master_port"}.get(launch.launcher, "--dist-url tcp://HOST:PORT")
        return (f"could not join the process group of {launch.world_size} processes at {launch.init_method}: "
                f"its port is in use on this node ({said}); choose a free one with {flag}")
    return (f"could not join the process group of {launch.world_size} processes at {launch.init_method} "
            f"within --dist-timeout {cfg.dist_timeout:g} s ({said}); check that every node runs "
            f"with the same --dist-url and --world-size, its own --rank, and can reach node 0")


class RendezvousError(UsageError):
    """A process that cannot meet its peers; each reports its own."""

    rank_specific = True


def join_process_group(cfg: Config, launch: Launch, rank: int, local_rank: int) -> Context:
    """Take this process's device, join the process group of `launch` as
    `rank` (or adopt Ray Train's), and make its Context."""
    if not gpu_of_its_own(launch.launcher, torch.cuda.device_count() if cfg.device != "cpu" else 0, local_rank):
        raise RendezvousError(f"local rank {local_rank} has no GPU of its own: {torch.cuda.device_count()} are "
                              f"visible on this node; start one process per GPU")
    device = select_device(cfg.device, local_rank)
    use_device(device)
    threads = cpu_threads_per_process(launch.procs_per_node) if device.type == "cpu" else None
    if threads is not None:
        torch.set_num_threads(threads)
    backend = cfg.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    if launch.launcher == "ray":
        # Ray Train joined the group before calling the script (its TorchConfig: the backend and
        # timeout run_scripts/ray_train.py chose from these flags); it is used, not joined again.
        backend = dist.get_backend()
    else:
        _join(cfg, launch, rank, backend, timeout)
    control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Context(rank=rank, local_rank=local_rank, world_size=launch.world_size, device=device, backend=backend,
                   launcher=launch.launcher, procs_per_node=launch.procs_per_node, control_group=control_group,
                   launcher_report=_report_to_ray if launch.launcher == "ray" else None)


def _report_to_ray(metrics: dict) -> None:
    # Every worker reports (Ray Train waits for all of them); Ray keeps rank 0's figures.
    sys.modules["ray.train"].report(metrics)


def _join(cfg: Config, launch: Launch, rank: int, backend: str, timeout: datetime.timedelta) -> None:
    with _stderr_held_back() as (replay, held):
        try:
            if launch.agent_store is not None:
                # torchrun's agent hosts one store for all its restarts, at the same address: without a
                # key prefix of their own, restarted workers can read the dead attempt's addresses and
                # fail to connect (or hang). Each attempt gets its own namespace in that store.
                host, port = launch.agent_store
                store = dist.PrefixStore(f"/imagenet-reference/attempt_{launch.restart_attempt}",
                                         dist.TCPStore(host, port, launch.world_size, is_master=False, timeout=timeout))
                dist.init_process_group(backend, store=store, rank=rank, world_size=launch.world_size, timeout=timeout)
            else:
                dist.init_process_group(backend, init_method=launch.init_method, rank=rank,
                                        world_size=launch.world_size, timeout=timeout)
        except Exception as error:  # DistNetworkError, DistStoreError, TimeoutError, RuntimeError: all one story
            raise RendezvousError(_join_failure(cfg, launch, error, held())) from None
        replay()


# The roll call after a collective timed out: how long the processes that timed out wait for each other's
# answer. They entered the collective within a step of each other, so they time out as close together.
ROLL_CALL_SECONDS = 10.0
_ROLL_CALL_KEY = "imagenet-reference/roll-call"


def roll_call_seconds(dist_timeout: float) -> float:
    return min(dist_timeout, ROLL_CALL_SECONDS)


def roll_call(rank: int, world_size: int, seconds: float, store=None) -> Optional[List[int]]:
    """After a collective timed out: the ranks that do not answer a roll
    call over the group's store within `seconds` (every process that timed
    out answers, then waits for the others; the ones that stopped answering
    never do). None when the store does not answer either: its host (rank 0
    unless torchrun's agent holds it) is the one stopped or gone. `store`:
    the default process group's unless given."""
    try:
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=seconds))
        store.set(f"{_ROLL_CALL_KEY}/{rank}", "here")
        counter = f"{_ROLL_CALL_KEY}/count"
        answered = store.add(counter, 1)  # the store replies: a stopped one times out here
        deadline = time.monotonic() + seconds
        while answered < world_size and time.monotonic() < deadline:  # one counter polled; each key read once
            time.sleep(min(0.5, seconds / 10))
            answered = store.add(counter, 0)
        return [other for other in range(world_size) if not store.check([f"{_ROLL_CALL_KEY}/{other}"])]
    except Exception:  # DistStoreError, a timeout, no store kept there: it cannot tell
        return None


# --- After joining: one GPU per process ---

@dataclasses.dataclass(frozen=True)
class GpuIdentity:
    """The GPU a training process computes on, as the processes of a job can
    compare it, and how the process came to it (what the line that stops a
    shared GPU says the likely cause is from)."""

    host: str  # this process's host name
    # CUDA's UUID of the device, as torch prints it (36 hexadecimal digits and dashes; nvidia-smi -L shows it after
    # "GPU-"): the same GPU has the same UUID whatever number CUDA_VISIBLE_DEVICES gives it in a process. A MIG
    # instance is a device of its own to CUDA, whose driver documents its own UUID for it (cuDeviceGetUuid_v2;
    # nvidia-smi -L's "MIG-..."), so processes on two instances of one GPU do not share one here (not yet seen on
    # MIG hardware: docs/faults.md).
    uuid: str
    local_rank: int
    device_index: int  # N of this process's cuda:N
    gpus_visible: int  # the GPUs this process sees (CUDA_VISIBLE_DEVICES, a Slurm or container binding)


def gpu_identity(ctx: Context) -> Optional[GpuIdentity]:
    """This process's GPU as the others can compare it; None on the CPU,
    where there is no GPU to share."""
    if ctx.device.type != "cuda":
        return None
    return GpuIdentity(host=socket.gethostname(), uuid=str(torch.cuda.get_device_properties(ctx.device).uuid),
                       local_rank=ctx.local_rank, device_index=ctx.device.index or 0,
                       gpus_visible=torch.cuda.device_count())


def shared_gpus(identities: Sequence[Optional[GpuIdentity]]) -> List[List[int]]:
    """The ranks (indices of `identities`, one per rank) that share a GPU,
    one list per GPU shared by two or more, in the order of their first rank.
    A GPU is its UUID alone: two containers of one machine may give one GPU
    to processes on hosts of different names. None (the CPU) shares nothing."""
    ranks_of_gpu: Dict[str, List[int]] = {}
    for rank, identity in enumerate(identities):
        if identity is not None:
            ranks_of_gpu.setdefault(identity.uuid, []).append(rank)
    return [ranks for ranks in ranks_of_gpu.values() if len(ranks) > 1]


# The line names at most this many of the GPUs shared, of the ranks on each, of their hosts and of the cuda:N
# numbers they see it as; the rest are counted: thousands of ranks on a few GPUs still make one short line.
SHARED_GPUS_NAMED = 3
RANKS_NAMED = 8
HOSTS_NAMED = 4
NUMBERS_NAMED = 4


def _listed(words: List[str], limit: int) -> str:
    """'a', 'a and b', 'a, b and c', or 'a, b and 5 more' past `limit` words."""
    if len(words) > limit:
        return f"{', '.join(words[:limit])} and {len(words) - limit} more"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _one_shared_gpu(ranks: List[int], identities: Sequence[GpuIdentity]) -> str:
    """'ranks 0 and 1 share one GPU (UUID ..., cuda:0 of each) on host node7'."""
    members = [identities[rank] for rank in ranks]
    indices = list(dict.fromkeys(f"cuda:{member.device_index}" for member in members))
    hosts = list(dict.fromkeys(member.host for member in members))
    as_seen = f"{indices[0]} of each" if len(indices) == 1 else f"as {_listed(indices, NUMBERS_NAMED)}"
    where = (f"on host {hosts[0]}" if len(hosts) == 1
             else f"on hosts {_listed(hosts, HOSTS_NAMED)} (one machine's containers?)")
    return (f"ranks {_listed([str(rank) for rank in ranks], RANKS_NAMED)} share one GPU (UUID {members[0].uuid}, "
            f"{as_seen}) {where}")


def _likely_cause(ranks: List[int], identities: Sequence[GpuIdentity]) -> str:
    """What the ranks sharing one GPU say of how they came to it, and what to set."""
    members = [identities[rank] for rank in ranks]
    seats = [(member.host, member.local_rank) for member in members]
    repeated = next((seat for seat in seats if seats.count(seat) > 1), None)
    if repeated is not None:
        return (f"{seats.count(repeated)} of them are local rank {repeated[1]} on host {repeated[0]}: the processes of "
                f"two nodes were started on one host; start each node's command on its own host, with its own node "
                f"rank")
    if all(member.gpus_visible == 1 for member in members):
        return ("each of them sees only that one GPU: the job gives its tasks the same GPU; give each its own "
                "(srun --gpus-per-task=1, or a CUDA_VISIBLE_DEVICES of its own per process)")
    return ("give each process a GPU of its own: one process per visible GPU, each its own local rank (check "
            "CUDA_VISIBLE_DEVICES and the launcher's process count per node)")


def shared_gpu_line(identities: Sequence[Optional[GpuIdentity]]) -> Optional[str]:
    """The one line that stops a job whose ranks share a GPU (identities: one
    per rank, in rank order; None on the CPU): which ranks share which GPU on
    which host, and the likely cause, from the first GPU shared; None when
    every process has a GPU of its own."""
    groups = shared_gpus(identities)
    if not groups:
        return None
    named = [_one_shared_gpu(ranks, identities) for ranks in groups[:SHARED_GPUS_NAMED]]
    if len(groups) > SHARED_GPUS_NAMED:
        named.append(f"{len(groups) - SHARED_GPUS_NAMED} more GPU(s) are shared likewise")
    return (f"{'; '.join(named)}; every process needs a GPU of its own (NCCL would stop at its first collective: "
            f"'Duplicate GPU detected'): {_likely_cause(groups[0], identities)}")


def check_gpu_binding(ctx: Context, identify: Optional[Callable[[Context], Optional[GpuIdentity]]] = None) -> None:
    """After joining, before NCCL's first collective (which fails late and
    obscurely on a GPU two ranks share): every process gathers each rank's
    GPU (`identify`, gpu_identity unless given) over the gloo group (the
    control group beside NCCL), and each raises the same UsageError when two
    share one. Skipped on the CPU: a process without a GPU asks nothing of
    the others (all of a job's processes compute on one kind of device: its
    backend is chosen from it). A peer that does not take part fails the
    gather within --dist-timeout, as any collective."""
    if not spans_processes(ctx):
        return
    own = (identify or gpu_identity)(ctx)
    if own is None:
        return
    line = shared_gpu_line(gather_to_all(own, ctx, group=ctx.control_group))
    if line is not None:
        raise UsageError(line)

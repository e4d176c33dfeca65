"""Joining the process group: each training process meets its peers here
and gets its common.distributed.Context (rank, device, backend). A process
that cannot meet them says why in one line (RendezvousError): what c10d
writes to stderr meanwhile (every failed attempt, with a C++ stack) is held
back, and the lines of it that say why are quoted. And, when a collective
timed out, the roll call over the group's store that tells which ranks
stopped answering (roll_call).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import tempfile
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import Context, select_device, use_device
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

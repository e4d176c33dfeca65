"""How this job was started, and starting it: the one place that reads
launchers' environment variables.

Seven launch styles end up here: plain `python SCRIPT` (one worker spawned
per GPU of this machine), one command per node (`--dist-url --world-size
NODES --rank NODE_RANK`, each node spawning its workers), torchrun,
torch.distributed.launch, srun with one task per GPU, srun with one task per
node (which spawns like the per-node style), and Ray Train
(run_scripts/ray_train.py), whose context gives rank and world size and
which has joined the process group before the script starts.
`discover` turns flags and environment into a `Launch` plan; `start` runs
`train(cfg, ctx)` in this process when a launcher made it one worker, or
spawns one worker per GPU and watches them. A worker that fails stops its
local peers; Ctrl-C or SIGTERM stops them all; workers and their
data-loading processes die with their parent, so no process outlives the
job. Each worker joins the process group here and gets its
common.distributed.Context.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import Context, select_device, use_device
from common.errors import (FAILED_EXIT_STATUS, INTERRUPTED_EXIT_STATUS, NONFINITE_EXIT_STATUS, PEER_LOST_EXIT_STATUS,
                           STOPPED_EXIT_STATUS, USAGE_EXIT_STATUS, WRITE_FAILED_EXIT_STATUS, UsageError, error_summary,
                           exit_status, program, skip_final_collection)

SLURM_PORT_BASE = 10000  # srun jobs meet on SLURM_PORT_BASE + job id % SLURM_PORT_SPAN, unless --dist-url says
SLURM_PORT_SPAN = 20000  # ... which keeps derived ports below Linux's ephemeral range (32768 and up)
WORKER_STOP_GRACE_SECONDS = 3.0  # after a worker fails, how long its peers get to exit (and report) on their own
WORKER_KILL_SECONDS = 5.0  # after SIGTERM, how long a worker gets before SIGKILL



@dataclasses.dataclass(frozen=True)
class Launch:
    """How the training processes of a job are started and where they meet."""

    launcher: str  # "spawn", "torchrun", "torch.distributed.launch", "slurm" or "ray"
    init_method: str  # "env://" (the launcher's variables), "tcp://HOST:PORT" of rank 0, or "ray" (joined already)
    world_size: int  # training processes in the job
    nodes: int
    node_rank: int
    procs_per_node: int
    rank: Optional[int] = None  # this process's global rank; None when this process spawns the workers
    local_rank: Optional[int] = None
    # torchrun after a restart: the attempt number, and the agent's store (host, port) its workers share.
    restart_attempt: Optional[int] = None
    agent_store: Optional[Tuple[str, int]] = None

    @property
    def spawns(self) -> bool:
        return self.rank is None

    def rank_of(self, local_rank: int) -> int:
        """Global rank of the local worker `local_rank` that this process spawns."""
        return self.node_rank * self.procs_per_node + local_rank


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'gpu[07-09,12],cpu01' -> 'gpu07',
    'node[1-2]-ib' -> 'node1-ib' (what `scontrol show hostnames | head -1` prints)."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):  # the first comma outside brackets ends the first entry
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    entry = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda match: re.split(r"[,-]", match.group(1))[0], entry)


def slurm_port(job_id: int) -> int:
    """The port every task of Slurm job `job_id` derives alike, without talking."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _tcp_address(url: str) -> tuple:
    match = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)", url)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise UsageError(f"argument --dist-url: expected tcp://HOST:PORT (the address of node 0), got {url!r}")
    return match.group(1).strip("[]"), int(match.group(2))


def free_local_port() -> int:
    """A TCP port on this machine that nothing listens on (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment_int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise UsageError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def ray_train_context():
    """Ray Train's context (rank, world size, run name) when this process is
    one of its training workers; None otherwise. Ray is not imported here:
    a process Ray started has it loaded already."""
    ray_train = sys.modules.get("ray.train")
    if ray_train is None:
        return None
    try:
        context = ray_train.get_context()
        context.get_world_rank()  # outside a training worker this raises
    except Exception:
        return None
    return context


def ray_head_address(flag: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The Ray cluster that run_scripts/ray_train.py and ray_tune.py join:
    --address, else RAY_ADDRESS (Ray's own variable), else None (a new one)."""
    return flag or environ.get("RAY_ADDRESS") or None


def check_launcher_flags(cfg: Config, what_the_launcher_did: str, local_rank_too: bool = False) -> None:
    """A launcher that starts every process itself (torchrun, Ray) leaves no
    part to the flags that tell this script how to start them."""
    flags = [("--world-size", cfg.world_size), ("--rank", cfg.rank), ("--dist-url", cfg.dist_url),
             ("--nproc-per-node", cfg.nproc_per_node)] + ([("--local-rank", cfg.local_rank)] if local_rank_too else [])
    for flag, value in flags:
        if value is not None:
            raise UsageError(f"argument {flag}: {what_the_launcher_did}; drop {flag} "
                             f"(it is for starting the script with plain python or srun)")


RAY_STARTS_THE_PROCESSES = "Ray Train starts the processes and gives them their ranks"


def discover(cfg: Config, environ: Mapping[str, str], gpus_visible: int, ray_context=None) -> Launch:
    """How this job is started, from the flags, the environment and Ray
    Train's context (the only place that reads them): under Ray Train the
    context gives the ranks; torchrun and torch.distributed.launch set RANK,
    WORLD_SIZE and LOCAL_RANK; srun sets SLURM_*; otherwise this process
    spawns the workers of its node (--world-size nodes, --rank this node's)."""
    per_node_flags = cfg.world_size is not None or cfg.rank is not None
    if ray_context is not None:
        # Ray also sets RANK and WORLD_SIZE, but has joined the process group already: it is adopted.
        check_launcher_flags(cfg, RAY_STARTS_THE_PROCESSES, local_rank_too=True)
        world_size, procs_per_node = ray_context.get_world_size(), ray_context.get_local_world_size()
        return Launch(launcher="ray", init_method="ray", world_size=world_size,
                      nodes=max(1, -(-world_size // procs_per_node)), node_rank=ray_context.get_node_rank(),
                      procs_per_node=procs_per_node, rank=ray_context.get_world_rank(),
                      local_rank=ray_context.get_local_rank())
    if "RANK" in environ and "WORLD_SIZE" in environ:
        check_launcher_flags(cfg, "the launcher already set RANK, WORLD_SIZE and MASTER_ADDR")
        world_size = _environment_int(environ, "WORLD_SIZE")
        local_rank = _environment_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else cfg.local_rank
        if local_rank is None:
            raise UsageError("environment: RANK and WORLD_SIZE are set but neither LOCAL_RANK nor --local-rank")
        procs_per_node = (_environment_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                          else world_size)
        launcher = "torch.distributed.launch" if cfg.local_rank is not None else "torchrun"
        agent_store = "TORCHELASTIC_RESTART_COUNT" in environ and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return Launch(launcher=launcher, init_method="env://", world_size=world_size,
                      nodes=max(1, world_size // procs_per_node),
                      node_rank=_environment_int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0,
                      procs_per_node=procs_per_node, rank=_environment_int(environ, "RANK"), local_rank=local_rank,
                      restart_attempt=_environment_int(environ, "TORCHELASTIC_RESTART_COUNT") if agent_store else None,
                      agent_store=((environ["MASTER_ADDR"], _environment_int(environ, "MASTER_PORT"))
                                   if agent_store else None))

    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ and not per_node_flags:
        tasks = _environment_int(environ, "SLURM_STEP_NUM_TASKS")
        nodes = _environment_int(environ, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in environ else 1
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if cfg.dist_url is not None:
            _tcp_address(cfg.dist_url)  # checks the form
            init_method = cfg.dist_url
        elif nodelist and "SLURM_JOB_ID" in environ:
            init_method = f"tcp://{first_slurm_host(nodelist)}:{slurm_port(_environment_int(environ, 'SLURM_JOB_ID'))}"
        else:
            raise UsageError("environment: srun set SLURM_PROCID but not SLURM_JOB_NODELIST and SLURM_JOB_ID; "
                             "pass --dist-url tcp://HOST:PORT")
        if tasks == nodes and (cfg.nproc_per_node or gpus_visible) > 1:
            # One task per node (srun --ntasks-per-node=1): each task spawns the workers of its node.
            return Launch(launcher="slurm", init_method=init_method,
                          world_size=nodes * (cfg.nproc_per_node or gpus_visible), nodes=nodes,
                          node_rank=_environment_int(environ, "SLURM_PROCID"),  # one task per node: its rank
                          procs_per_node=cfg.nproc_per_node or gpus_visible)
        if cfg.nproc_per_node not in (None, tasks // nodes):
            raise UsageError(f"argument --nproc-per-node: srun already started {tasks // nodes} processes per "
                             f"node (one per task); drop the flag or start one task per node")
        return Launch(launcher="slurm", init_method=init_method, world_size=tasks, nodes=nodes,
                      node_rank=_environment_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0,
                      procs_per_node=max(1, tasks // nodes), rank=_environment_int(environ, "SLURM_PROCID"),
                      local_rank=_environment_int(environ, "SLURM_LOCALID"))

    nodes = cfg.world_size if cfg.world_size is not None else 1
    node_rank = cfg.rank if cfg.rank is not None else 0
    if nodes > 1 and cfg.rank is None:
        raise UsageError(f"argument --rank: needed with --world-size {nodes} (this node's rank, 0 to {nodes - 1})")
    if nodes > 1 and cfg.dist_url is None:
        raise UsageError(f"argument --dist-url: needed with --world-size {nodes} "
                         f"(tcp://HOST:PORT of node 0, the same on every node)")
    procs_per_node = cfg.nproc_per_node or max(gpus_visible, 1)
    if gpus_visible and procs_per_node > gpus_visible and cfg.device != "cpu":
        raise UsageError(f"argument --nproc-per-node: {procs_per_node} processes but {gpus_visible} GPUs are "
                         f"visible; DDP runs one process per GPU")
    if cfg.dist_url is not None:
        _tcp_address(cfg.dist_url)  # checks the form
        init_method = cfg.dist_url
    else:
        init_method = f"tcp://127.0.0.1:{free_local_port()}"
    return Launch(launcher="spawn", init_method=init_method, world_size=nodes * procs_per_node, nodes=nodes,
                  node_rank=node_rank, procs_per_node=procs_per_node)


def _check_before_start(cfg: Config, launch: Launch, gpus_visible: int) -> None:
    """The mistakes that can be seen before any process waits for another."""
    uses_gpus = gpus_visible > 0 and cfg.device != "cpu"
    if cfg.dist_backend == "nccl" and not uses_gpus:
        raise UsageError("argument --dist-backend: nccl needs CUDA GPUs and none is in use; use gloo")
    if cfg.sync_bn and not uses_gpus:
        raise UsageError("argument --sync-bn: SyncBatchNorm needs CUDA GPUs (PyTorch has no CPU implementation)")
    if launch.spawns and launch.node_rank == 0 and launch.init_method.startswith("tcp://"):
        # Node 0 hosts the rendezvous: a port already in use is an error now, not a timeout later.
        host, port = _tcp_address(launch.init_method)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # SO_REUSEADDR as the rendezvous server sets it: a port in TIME_WAIT after the last run is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                raise UsageError(f"argument --dist-url: port {port} on this node is in use ({error.strerror}); "
                                 f"choose another port") from None


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, even
    by SIGKILL, so no worker is left holding a GPU, a port or memory."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
            os._exit(1)


def data_loader_worker_init(worker_id: int) -> None:
    """DataLoader worker_init_fn: data-loading processes die with their
    trainer, say nothing when it stops in the middle of a transfer, and
    leave stop signals to it: Slurm signals every process of a job step, and
    a data-loading worker that died of one would end the trainer with an
    error before it could write its checkpoint."""
    _die_with_parent()
    sys.excepthook = _silent_when_the_trainer_is_gone
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # SIGTERM still has to end the worker when the trainer sends it (DataLoader and multiprocessing
    # stop workers that way), so it cannot simply be ignored: it is blocked, and a thread takes each
    # one and looks at its sender.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from_parent, daemon=True, name="sigterm-from-parent").start()


class _WorkerProcess(multiprocessing.context.ForkProcess):
    """A data-loading worker forked with SIGTERM blocked (see data_loader_context)."""

    def start(self) -> None:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _WorkerContext(multiprocessing.context.ForkContext):
    Process = _WorkerProcess


def data_loader_context() -> Optional[multiprocessing.context.BaseContext]:
    """The multiprocessing context for DataLoader workers: fork, as on Linux
    by default, but with SIGTERM blocked from the child's first instruction.
    Threads that libraries start in the child before data_loader_worker_init
    runs (at fork, or in torch.set_num_threads(1): seen once a gloo group has
    joined) inherit that mask; started with SIGTERM open, any of them could
    take a SIGTERM from another process (slurmstepd signals every process of
    a job) and the worker would die of it. None (the default context) where
    fork is not what multiprocessing uses here."""
    method = multiprocessing.get_start_method(allow_none=True)  # None: not chosen yet (not fixed by asking)
    default = "forkserver" if sys.version_info >= (3, 14) else "fork"  # Linux's, since Python 3.14 forkserver
    if not sys.platform.startswith("linux") or (method or default) != "fork":
        return None
    return _WorkerContext()


def _exit_on_sigterm_from_parent() -> None:
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)


def ignore_stop_signals_until_training() -> None:
    """SIGUSR1 and SIGUSR2 end a process by default: until training installs
    its handlers (common.preemption.StopControl), a preemption warning that
    arrives during start-up is ignored instead of killing the process."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)


def _silent_when_the_trainer_is_gone(kind, value, traceback) -> None:
    # Batches travel as file descriptors, sent by a multiprocessing thread that reports a trainer
    # closing the connection mid-send (Ctrl-C, a stopped job) through sys.excepthook: a traceback
    # after "interrupted" that means nothing. Data errors do not come here: the DataLoader sends
    # them to the trainer, which reports them.
    if not issubclass(kind, (ConnectionError, EOFError)):
        sys.__excepthook__(kind, value, traceback)


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


def gpu_of_its_own(launcher: str, gpus_visible: int, local_rank: int) -> bool:
    """Whether local rank `local_rank` has a GPU no other process of its node
    takes (or runs on the CPU). srun --gpus-per-task=1, or a cgroup per task,
    shows each process its own GPU alone, as device 0."""
    return gpus_visible == 0 or local_rank < gpus_visible or (launcher == "slurm" and gpus_visible == 1)


def _join_process_group(cfg: Config, launch: Launch, rank: int, local_rank: int) -> Context:
    if not gpu_of_its_own(launch.launcher, torch.cuda.device_count() if cfg.device != "cpu" else 0, local_rank):
        raise RendezvousError(f"local rank {local_rank} has no GPU of its own: {torch.cuda.device_count()} are "
                              f"visible on this node; start one process per GPU")
    device = select_device(cfg.device, local_rank)
    use_device(device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Processes of one node share its cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.procs_per_node))
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
                   launcher=launch.launcher, control_group=control_group,
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


# What a collective raises when a peer process has gone (gloo, NCCL): the peer's own output says why.
_PEER_LOSS_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "NCCL communicator was aborted", "remote process exited or there was a network error")


def _lost_a_peer(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_LOSS_MESSAGES)


def _run_worker(train: Callable[[Config, Context], None], cfg: Config, launch: Launch, local_rank: int,
                spawned: bool = False) -> None:
    """Join the process group, train, leave. A collective broken by a peer
    that failed is one line (under a launcher: its log is the place to look)
    or, in a worker this script spawned, a quiet exit for the spawner to
    report: not a second traceback beside the one that matters."""
    rank = launch.rank if launch.rank is not None else launch.rank_of(local_rank)
    ctx = _join_process_group(cfg, launch, rank, local_rank)
    try:
        train(cfg, ctx)
    except RuntimeError as error:
        if not _lost_a_peer(error):
            raise
        if not spawned:
            print(f"{program()}: error: rank {rank}: lost the connection to another process "
                  f"({error_summary(error)}); it failed or was stopped: its output says why", file=sys.stderr,
                  flush=True)
        sys.exit(PEER_LOST_EXIT_STATUS)
    finally:
        if launch.launcher != "ray":  # Ray Train leaves the group it joined
            dist.destroy_process_group()


def _spawned_worker(local_rank: int, train, cfg: Config, launch: Launch) -> None:
    _die_with_parent()
    # A process started by the spawn context inherits "spawn" as its default start method, so its
    # DataLoader workers would be spawned too: every epoch, for training and again for validation,
    # each of them importing torch afresh. Measured: the digits demo's epoch took about 20 s instead
    # of 2.6 on the H200 machine, and 3 short epochs 48 s instead of 3.5 on 2 CPU cores. Forgetting it
    # makes them fork, as under torchrun and in imagenet_nd.py.
    multiprocessing.set_start_method(None, force=True)
    # Until training starts (and asks for a clean stop instead), SIGTERM unwinds as for Ctrl-C, so
    # data-loading processes and their shared-memory queues are cleaned up (SIGKILL follows if this
    # takes too long).
    signal.signal(signal.SIGTERM, _interrupt)
    ignore_stop_signals_until_training()
    try:
        _run_worker(train, cfg, launch, local_rank, spawned=True)
    except (UsageError, KeyboardInterrupt) as error:
        # Ctrl-C reaches every process of the terminal: the spawner says it, not each worker.
        sys.exit(exit_status(error, launch.rank_of(local_rank), local_rank, say_interrupted=False))
    finally:
        skip_final_collection()


def launched_identity(environ: Mapping[str, str] = os.environ) -> Tuple[Optional[int], Optional[int]]:
    """(rank, local rank) of this process when a launcher (torchrun,
    torch.distributed.launch, srun) started it as one of several; (None, None)
    otherwise. For reporting an error once per node, even before the process
    group exists."""
    for rank_name, local_name, needs in (("RANK", "LOCAL_RANK", "WORLD_SIZE"),
                                         ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")):
        if needs in environ and environ.get(rank_name, "").isdigit():
            local = environ.get(local_name, "")
            return int(environ[rank_name]), int(local) if local.isdigit() else None
    return None, None


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The Slurm job this process runs in (what `scontrol requeue` takes); None outside Slurm."""
    return environ.get("SLURM_JOB_ID") or None


def restart_name(environ: Mapping[str, str] = os.environ, ray_context=None) -> Optional[str]:
    """A name for this job that stays the same when it starts again (requeued
    by Slurm, restarted by torchrun or by Ray Train after a failure):
    slurm-<job>[_<array task>], torchrun-<run id> or ray-<Ray Train run>;
    None when the launcher gives none."""
    if ray_context is not None:  # run_scripts/ray_train.py names each of its runs afresh
        return f"ray-{ray_context.get_experiment_name()}"
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    job_id = slurm_job_id(environ)
    if job_id:
        return f"slurm-{job_id}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return f"torchrun-{run_id}"
    return None


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _stop(processes) -> None:
    """SIGTERM every live worker, then SIGKILL what is still alive after a grace period."""
    processes = [process for process in processes if process.pid is not None]  # Ctrl-C may come mid-start
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + WORKER_KILL_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _spawn_and_watch(train, cfg: Config, launch: Launch) -> None:
    """Start this node's workers and wait for them. The first failure stops
    the rest (after a moment to exit on their own) and sets the exit status.
    Stop signals (SIGTERM, --preempt-signal) are passed on to the workers,
    which stop cleanly together; a second one, or Ctrl-C, stops them at once."""
    spawn = multiprocessing.get_context("spawn")  # fork would copy a CUDA-initialised parent
    workers = [spawn.Process(target=_spawned_worker, args=(local_rank, train, cfg, launch),
                             name=f"rank{launch.rank_of(local_rank)}")
               for local_rank in range(launch.procs_per_node)]

    signals_received = []

    def pass_on(signum, frame):
        signals_received.append(signum)
        if len(signals_received) > 1:  # asked twice: stop now (a hung job must still be stoppable)
            raise KeyboardInterrupt
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:  # it exited meanwhile
                    pass

    stop_signals = {signal.SIGTERM, signal.Signals[cfg.preempt_signal]}
    previous = {signum: signal.signal(signum, pass_on) for signum in stop_signals}
    try:
        for worker in workers:
            worker.start()
        _watch(workers)
    except KeyboardInterrupt:
        _stop(workers)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch(workers) -> None:
    """Wait until every worker has exited with status 0 (or all stopped
    cleanly on a signal: then exit with STOPPED_EXIT_STATUS), or report the
    first failure (which stops the others and exits)."""
    running = list(workers)
    stopped = False
    while running:
        multiprocessing.connection.wait([worker.sentinel for worker in running])
        # Read each exit code once: a read as None (not yet reaped) and then as 2 by a second read
        # would drop a failed worker without reporting it, and the job would exit 0.
        exit_codes = [(worker, worker.exitcode) for worker in running]
        stopped = stopped or any(code == STOPPED_EXIT_STATUS for _, code in exit_codes)
        running = [worker for worker, code in exit_codes if code is None]
        if _failures(exit_codes):
            _report_failure(workers, running)
    if stopped:
        sys.exit(STOPPED_EXIT_STATUS)


def _failures(exit_codes):
    """The (worker, exit code) pairs of workers that ended with an error (not done, nor stopped cleanly)."""
    return [(worker, code) for worker, code in exit_codes if code not in (None, 0, STOPPED_EXIT_STATUS)]


def _first_cause(failed):
    """Of workers that ended together, the one to name: one killed by a signal
    before one that exited with an error status, and either before one that
    only lost its connection to them."""
    return min(failed, key=lambda pair: (pair[1] >= 0, pair[1] == PEER_LOST_EXIT_STATUS))[0]


def _report_failure(workers, running) -> None:
    if running:  # a moment for the others to exit on their own (they often fail on the broken connection)
        multiprocessing.connection.wait([worker.sentinel for worker in running], timeout=WORKER_STOP_GRACE_SECONDS)
    ended = [(worker, worker.exitcode) for worker in workers]
    failed = _first_cause(_failures(ended))
    _stop([worker for worker, code in ended if code is None])
    code = failed.exitcode
    # A UsageError, a NaN loss, a checkpoint the run could not write: the worker has said it.
    if code in (USAGE_EXIT_STATUS, NONFINITE_EXIT_STATUS, WRITE_FAILED_EXIT_STATUS):
        sys.exit(code)
    if code == INTERRUPTED_EXIT_STATUS:
        raise KeyboardInterrupt
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    if code == PEER_LOST_EXIT_STATUS:
        how = "lost its connection to another process (one on another node failed or was stopped?)"
    if code == -signal.SIGKILL:
        how += " (by the kernel's out-of-memory killer, if nobody sent it)"
    print(f"{program()}: error: worker {failed.name} {how}; stopped the other workers of this node",
          file=sys.stderr, flush=True)
    sys.exit(FAILED_EXIT_STATUS)


def start(train: Callable[[Config, Context], None], cfg: Config) -> None:
    """Run `train(cfg, ctx)` in every training process of this node: here,
    when a launcher started this process as one worker; otherwise in one
    spawned worker per GPU (or per --nproc-per-node on the CPU)."""
    gpus_visible = torch.cuda.device_count() if cfg.device != "cpu" else 0
    plan = discover(cfg, os.environ, gpus_visible, ray_train_context())
    _check_before_start(cfg, plan, gpus_visible)
    if not plan.spawns:
        _run_worker(train, cfg, plan, plan.local_rank)
        return
    if plan.node_rank == 0:
        print(f"starting {plan.procs_per_node} worker processes on this node ({plan.nodes} node(s), world size "
              f"{plan.world_size}, rendezvous {plan.init_method})", flush=True)
    _spawn_and_watch(train, cfg, plan)

"""How this job was started: the one place that reads launchers' environment
variables. Imports no torch, so the command line (common.cli) can use it.

Seven launch styles end up here: plain `python SCRIPT` (one worker spawned
per GPU of this machine), one command per node (`--dist-url --world-size
NODES --rank NODE_RANK`, each node spawning its workers), torchrun,
torch.distributed.launch, srun with one task per GPU, srun with one task per
node (which spawns like the per-node style), and Ray Train
(run_scripts/ray_train.py), whose context gives rank and world size and
which has joined the process group before the script starts.
`discover` turns flags and environment into a `Launch` plan, which
common.spawn carries out. This module also names the job for restarts (the
Slurm job id, torchrun's run id, Ray Train's run) and decides the CPU
threads of each process (unless OMP_NUM_THREADS says).
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from typing import Mapping, Optional, Tuple

from common.arguments import check_fits_in_memory, data_workers_bytes, memory_bytes, usable_cores
from common.config import Config
from common.errors import UsageError
from common.ports import free_port

SLURM_PORT_BASE = 10000  # srun jobs meet on SLURM_PORT_BASE + job id % SLURM_PORT_SPAN, unless --dist-url says
SLURM_PORT_SPAN = 20000  # ... which keeps derived ports below Linux's ephemeral range (32768 and up)


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


def tcp_address(url: str) -> tuple:
    """(host, port) of a --dist-url tcp://HOST:PORT; a UsageError for any other
    form, one with a user name or password in it too (quoted without it)."""
    if "@" in url:
        raise UsageError(f"argument --dist-url: {url!r} holds credentials (a user name or password before @), "
                         f"which the rendezvous never takes; give tcp://HOST:PORT of node 0")
    match = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)", url)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise UsageError(f"argument --dist-url: expected tcp://HOST:PORT (the address of node 0), got {url!r}")
    return match.group(1).strip("[]"), int(match.group(2))


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
        return _ray_launch(cfg, ray_context)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _torchrun_launch(cfg, environ)
    _refuse_half_a_launch(environ)
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ and not per_node_flags:
        return _slurm_launch(cfg, environ, gpus_visible)
    return _spawn_launch(cfg, gpus_visible)


# What torchrun and torch.distributed.launch set in every process they start, all together (the latter
# LOCAL_RANK only with --use-env; otherwise --local-rank is a flag).
TORCHRUN_LAUNCH = ("a launcher (torchrun, torch.distributed.launch) sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                   "and LOCAL_RANK together")


def _refuse_half_a_launch(environ: Mapping[str, str]) -> None:
    """RANK, WORLD_SIZE or LOCAL_RANK without the rest of a launcher's set
    (left exported in a shell, or a launcher's script missing a line) would
    have run one job of this node's own, as if none were set: the other
    processes the variables speak of would never meet it. WORLD_SIZE=1
    alone says one process, which is what runs. MASTER_ADDR and MASTER_PORT
    alone are left alone: scripts export them for the per-node flags too."""
    found = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
             if name in environ]
    if not found or (found == ["WORLD_SIZE"] and environ["WORLD_SIZE"].strip() == "1"):
        return
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
    shown = ", ".join(f"{name}={environ[name]!r}" for name in found)
    raise UsageError(f"environment: {shown} set but {' and '.join(missing)} not: {TORCHRUN_LAUNCH}; unset "
                     f"{', '.join(found)} to start the processes here, or start the script with torchrun")


class RankOutsideError(UsageError):
    """A process's own rank variable outside its world: its peers may have
    theirs right, so it reports this itself (errors.report)."""

    rank_specific = True


def _rank_within(environ: Mapping[str, str], name: str, count: int, count_name: str) -> int:
    """The integer environment variable `name`, which must be a rank among
    `count` (0 to count - 1), `count_name` saying where that count came from."""
    value = _environment_int(environ, name)
    if not 0 <= value < count:
        raise RankOutsideError(f"environment variable {name}={value} is outside 0 to {count - 1}, the ranks of "
                               f"the {count} process(es) {count_name} says")
    return value


def _ray_launch(cfg: Config, ray_context) -> Launch:
    check_launcher_flags(cfg, RAY_STARTS_THE_PROCESSES, local_rank_too=True)
    world_size, procs_per_node = ray_context.get_world_size(), ray_context.get_local_world_size()
    return Launch(launcher="ray", init_method="ray", world_size=world_size,
                  nodes=max(1, -(-world_size // procs_per_node)), node_rank=ray_context.get_node_rank(),
                  procs_per_node=procs_per_node, rank=ray_context.get_world_rank(),
                  local_rank=ray_context.get_local_rank())


def _torchrun_launch(cfg: Config, environ: Mapping[str, str]) -> Launch:
    """torchrun, or torch.distributed.launch (which passes --local-rank as a flag)."""
    check_launcher_flags(cfg, "the launcher already set RANK, WORLD_SIZE and MASTER_ADDR")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in environ]
    if "LOCAL_RANK" not in environ and cfg.local_rank is None:
        missing.append("LOCAL_RANK (or --local-rank)")
    if missing:  # env:// would fail later, with a traceback naming the first one only
        raise UsageError(f"environment: RANK and WORLD_SIZE set but {', '.join(missing)} not: {TORCHRUN_LAUNCH}")
    world_size = _environment_int(environ, "WORLD_SIZE")
    if world_size < 1:
        raise UsageError(f"environment variable WORLD_SIZE={world_size} is not a number of processes")
    rank = _rank_within(environ, "RANK", world_size, "WORLD_SIZE")
    procs_per_node = (_environment_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                      else world_size)
    where = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in environ else "WORLD_SIZE"
    if "LOCAL_RANK" in environ:
        local_rank = _rank_within(environ, "LOCAL_RANK", procs_per_node, where)
    elif not 0 <= cfg.local_rank < procs_per_node:
        raise RankOutsideError(f"argument --local-rank: {cfg.local_rank} is outside 0 to {procs_per_node - 1}, the "
                               f"ranks of the {procs_per_node} process(es) {where} says")
    else:
        local_rank = cfg.local_rank
    launcher = "torch.distributed.launch" if cfg.local_rank is not None else "torchrun"
    agent_store = "TORCHELASTIC_RESTART_COUNT" in environ and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return Launch(launcher=launcher, init_method="env://", world_size=world_size,
                  nodes=max(1, world_size // procs_per_node),
                  node_rank=_environment_int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0,
                  procs_per_node=procs_per_node, rank=rank, local_rank=local_rank,
                  restart_attempt=_environment_int(environ, "TORCHELASTIC_RESTART_COUNT") if agent_store else None,
                  agent_store=((environ["MASTER_ADDR"], _environment_int(environ, "MASTER_PORT"))
                               if agent_store else None))


def _slurm_launch(cfg: Config, environ: Mapping[str, str], gpus_visible: int) -> Launch:
    """srun: one task per GPU (each task a worker), or one task per node (each spawning its node's workers)."""
    tasks = _environment_int(environ, "SLURM_STEP_NUM_TASKS")
    nodes = _environment_int(environ, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in environ else 1
    init_method = _slurm_init_method(cfg, environ)
    if tasks == nodes and (cfg.nproc_per_node or gpus_visible) > 1:
        # One task per node (srun --ntasks-per-node=1): each task spawns the workers of its node.
        return Launch(launcher="slurm", init_method=init_method,
                      world_size=nodes * (cfg.nproc_per_node or gpus_visible), nodes=nodes,
                      node_rank=_rank_within(environ, "SLURM_PROCID", tasks, "SLURM_STEP_NUM_TASKS"),  # one per node
                      procs_per_node=cfg.nproc_per_node or gpus_visible)
    if cfg.nproc_per_node not in (None, tasks // nodes):
        raise UsageError(f"argument --nproc-per-node: srun already started {tasks // nodes} processes per "
                         f"node (one per task); drop the flag or start one task per node")
    if "SLURM_LOCALID" not in environ:
        raise UsageError("environment: srun set SLURM_PROCID and SLURM_STEP_NUM_TASKS but not SLURM_LOCALID "
                         "(this task's rank on its node), which srun sets with them")
    return Launch(launcher="slurm", init_method=init_method, world_size=tasks, nodes=nodes,
                  node_rank=_environment_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0,
                  procs_per_node=max(1, tasks // nodes),
                  rank=_rank_within(environ, "SLURM_PROCID", tasks, "SLURM_STEP_NUM_TASKS"),
                  local_rank=_rank_within(environ, "SLURM_LOCALID", tasks, "SLURM_STEP_NUM_TASKS"))


def _slurm_init_method(cfg: Config, environ: Mapping[str, str]) -> str:
    """Where srun's tasks meet: --dist-url, else the job's first host at a port derived from its id."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if cfg.dist_url is not None:
        tcp_address(cfg.dist_url)  # checks the form
        return cfg.dist_url
    if nodelist and "SLURM_JOB_ID" in environ:
        return f"tcp://{first_slurm_host(nodelist)}:{slurm_port(_environment_int(environ, 'SLURM_JOB_ID'))}"
    raise UsageError("environment: srun set SLURM_PROCID but not SLURM_JOB_NODELIST and SLURM_JOB_ID; "
                     "pass --dist-url tcp://HOST:PORT")


def _spawn_launch(cfg: Config, gpus_visible: int) -> Launch:
    """Plain python, on one node or with the per-node flags: this process spawns its node's workers."""
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
        tcp_address(cfg.dist_url)  # checks the form
        init_method = cfg.dist_url
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    return Launch(launcher="spawn", init_method=init_method, world_size=nodes * procs_per_node, nodes=nodes,
                  node_rank=node_rank, procs_per_node=procs_per_node)


def check_node_processes(procs_per_node: int, workers: int, batch_size: int, image_size: int, share_cores: bool,
                         cores: Optional[int] = None, memory: Optional[int] = None) -> None:
    """Process counts this node cannot run, each a UsageError: more training
    processes than cores, where they compute on the CPU and share the cores
    this process may use (`share_cores`; `cores`, default usable_cores()):
    each would get less than one, and the job would crawl for minutes before
    its first step; or more data-loading processes than the node's memory
    holds (`memory`, default memory_bytes()), each with its own pages and its
    prefetched batches of uint8 crops. Arithmetic only."""
    cores = usable_cores() if cores is None else cores
    if share_cores and procs_per_node > cores:
        raise UsageError(f"argument --nproc-per-node: {procs_per_node} training processes on the CPU, but this node "
                         f"gives the job {cores} core(s); at most one process per core (under torchrun or srun, "
                         f"start fewer)")
    check_fits_in_memory("-j/--workers", data_workers_bytes(procs_per_node * workers, batch_size, image_size),
                         f"-j {workers} data-loading processes x --nproc-per-node {procs_per_node} on this node, "
                         f"with batches of -b {batch_size} at --image-size {image_size}",
                         memory_bytes() if memory is None else memory)


def oversubscription(procs_per_node: int, workers: int, cores: Optional[int] = None) -> Optional[str]:
    """The one warning line for a node whose data-loading processes
    outnumber the cores the job may use (legal, but they take turns: slower,
    not faster); None when they do not."""
    cores = usable_cores() if cores is None else cores
    loaders = procs_per_node * workers
    if loaders <= cores:
        return None
    processes = f" x {procs_per_node} training processes" if procs_per_node > 1 else ""
    return (f"warning: -j {workers}{processes} = {loaders} data-loading processes on this node's {cores} core(s): "
            f"oversubscribed, they take turns; -j {max(1, cores // procs_per_node)} or fewer runs as fast")


def check_before_start(cfg: Config, launch: Launch, gpus_visible: int) -> None:
    """The mistakes that can be seen before any process waits for another."""
    uses_gpus = gpus_visible > 0 and cfg.device != "cpu"
    # srun may bind each of its tasks to cores of their own, and Ray places its workers by the CPUs it was given
    # (--cpus-per-worker): the cores this process sees are then its own, not its node's.
    share_cores = not uses_gpus and (launch.spawns or launch.launcher in ("torchrun", "torch.distributed.launch"))
    if launch.launcher != "ray":
        check_node_processes(launch.procs_per_node, cfg.workers, cfg.batch_size, cfg.image_size, share_cores)
    if cfg.dist_backend == "nccl" and not uses_gpus:
        raise UsageError("argument --dist-backend: nccl needs CUDA GPUs and none is in use; use gloo")
    if cfg.sync_bn and not uses_gpus:
        raise UsageError("argument --sync-bn: SyncBatchNorm needs CUDA GPUs (PyTorch has no CPU implementation)")
    if launch.spawns and launch.node_rank == 0 and launch.init_method.startswith("tcp://"):
        # Node 0 hosts the rendezvous: a port already in use is an error now, not a timeout later.
        host, port = tcp_address(launch.init_method)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # SO_REUSEADDR as the rendezvous server sets it: a port in TIME_WAIT after the last run is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                raise UsageError(f"argument --dist-url: port {port} on this node is in use ({error.strerror}); "
                                 f"choose another port") from None


def gpu_of_its_own(launcher: str, gpus_visible: int, local_rank: int) -> bool:
    """Whether local rank `local_rank` has a GPU no other process of its node
    takes (or runs on the CPU). srun --gpus-per-task=1, or a cgroup per task,
    shows each process its own GPU alone, as device 0."""
    return gpus_visible == 0 or local_rank < gpus_visible or (launcher == "slurm" and gpus_visible == 1)


def cpu_threads_per_process(procs_per_node: int, environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The CPU threads each of a node's `procs_per_node` CPU processes should
    use: its share of the cores the job may use (usable_cores: a Slurm
    allocation's or a cpuset's, not the machine's), since they share them
    (each would start one thread per core otherwise); None when
    OMP_NUM_THREADS already says."""
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, usable_cores() // procs_per_node)


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

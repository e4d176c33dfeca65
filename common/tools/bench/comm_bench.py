"""The processes of the benchmark's comm and scaling sections (common.tools.bench.sections):
what runs inside each of the N processes they start.

  comm     all-reduce of float32 tensors of each size, warm-up then timed
           iterations, on the backend in use (gloo on the CPU, nccl on GPUs);
           times and bandwidths as nccl-tests defines them:
             algbw = size_bytes / time,  busbw = algbw * 2(n-1)/n  (all-reduce),
           busbw being what each link of a ring carries, comparable across n.
  scaling  a DDP training step (common.comm.distributed_model around
           common.models.build_model, synthetic tensors already on the device)
           timed twice in each process: with gradient synchronisation, and
           with it switched off (every step under DDP's no_sync()). The
           difference is the communication the step could not hide behind
           backward (exposed); the no_sync step is the compute.

Also a command, for processes started one per machine (or per network
namespace, as common.tools.link_validation does):

    python -m common.tools.bench.comm_bench --init tcp://HOST:PORT --rank R --world-size N --sizes 4096 67108864
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing

from common import comm, models
from common.arguments import Parser, non_negative_int, positive_int
from common.config import Config
from common.distributed import Context
from common.errors import run_main
from common.tools.scaling import bus_bandwidth

KIB, MIB = 1 << 10, 1 << 20
# When run alone (python -m common.tools.bench.comm_bench): the CPU sizes of `make bench` (command_line.comm_sizes_default).
CPU_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB)


def time_allreduce(sizes: Sequence[int], device: torch.device, warmup: int, iterations: int,
                   budget_seconds: float) -> List[dict]:
    """In a process group: per size (bytes), the mean time of an all-reduce
    over `iterations` (fewer where a warm-up iteration says they would take
    more than `budget_seconds`, never under 3), the slowest process's."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        started = time.perf_counter()
        for _ in range(max(1, warmup)):
            dist.all_reduce(tensor)
        _synchronize(device)
        warm = torch.tensor([(time.perf_counter() - started) / max(1, warmup)], dtype=torch.float64, device=device)
        dist.all_reduce(warm, op=dist.ReduceOp.MAX)  # every process takes the same count
        count = max(3, min(iterations, int(budget_seconds / max(float(warm), 1e-9))))
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor)
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - started) / count], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed)
        algbw = tensor.numel() * 4 / seconds
        rows.append({"size_bytes": tensor.numel() * 4, "iterations": count, "time_us": 1e6 * seconds,
                     "algbw_gbytes_per_s": algbw / 1e9, "busbw_gbytes_per_s": bus_bandwidth(algbw, world) / 1e9})
    return rows


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _join(rank: int, world: int, init_method: str, backend: str, threads: int) -> torch.device:
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)  # the processes share the machine's cores
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return device


def _allreduce_rank(rank: int, spec: dict, out: str, cfg: Optional[Config] = None) -> None:
    device = _join(rank, spec["world_size"], spec["init_method"], spec["backend"], spec["threads"])
    try:
        rows = time_allreduce(spec["sizes"], device, spec["warmup"], spec["iterations"], spec["budget_seconds"])
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


# --- a DDP step with and without gradient synchronisation --------------------------------------------------

def ddp_step_times(cfg: Config, warmup: int, steps: int, device: torch.device, rank: int, world: int,
                   backend: str) -> dict:
    """In a process group: ms per step of DDP training (cfg: the model, batch,
    image size and DDP options, as imagenet_ddp.py's flags give them) with synchronisation
    (after `warmup` synchronised steps: buckets rebuilt, PowerSGD past its
    start step) and with every step under no_sync(), `steps` each, the blocks
    alternating in halves so that a drift of the machine's speed falls on
    both alike; each the slowest process's mean."""
    torch.manual_seed(0)
    model = models.build_model(cfg.arch, 1000, image_size=cfg.image_size).to(device)
    ctx = Context(rank=rank, local_rank=rank, world_size=world, device=device, backend=backend)
    ddp, _ = comm.distributed_model(model, cfg, ctx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=device)
    target = torch.randint(0, 1000, (cfg.batch_size,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(images), target).backward()
        optimizer.step()

    def timed(count: int, synchronised: bool) -> float:
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(count):
            if synchronised:
                step()
            else:
                with ddp.no_sync():
                    step()
        _synchronize(device)
        return time.perf_counter() - started

    for _ in range(warmup):
        step()
    first, second = steps // 2, steps - steps // 2
    sync = timed(first, True) + timed(second, True) if first else timed(second, True)
    alone = timed(first, False) + timed(second, False) if first else timed(second, False)
    figures = torch.tensor([sync / steps, alone / steps], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux: this process's peak
    return {"sync_ms": 1000.0 * float(figures[0]), "no_sync_ms": 1000.0 * float(figures[1]), "peak_memory_mib": peak}


def _scaling_rank(rank: int, spec: dict, out: str, cfg: Config) -> None:
    device = _join(rank, spec["world_size"], spec["init_method"], spec["backend"], spec["threads"])
    try:
        figures = ddp_step_times(cfg, spec["warmup"], spec["steps"], device, rank, spec["world_size"], spec["backend"])
        if rank == 0:
            Path(out).write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def spawned(kind: str, spec: dict, cfg: Optional[Config] = None) -> object:
    """spec["world_size"] processes on this machine (torch.multiprocessing),
    each running `kind` ("comm", or "scaling" with `cfg`); what the first one found."""
    import tempfile

    target = {"comm": _allreduce_rank, "scaling": _scaling_rank}[kind]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        torch.multiprocessing.spawn(target, args=(spec, out, cfg), nprocs=spec["world_size"], join=True)
        return json.loads(Path(out).read_text())


# --- the command: one process of an all-reduce measurement ---------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.bench.comm_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", required=True, metavar="URL", help="tcp://HOST:PORT of rank 0")
    parser.add_argument("--rank", type=non_negative_int, required=True)
    parser.add_argument("--world-size", type=positive_int, required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=list(CPU_SIZES), metavar="BYTES")
    parser.add_argument("--warmup", type=positive_int, default=2)
    parser.add_argument("--iterations", type=positive_int, default=20)
    parser.add_argument("--budget-seconds", type=float, default=2.0, help="per size, at most (3 iterations at least)")
    parser.add_argument("--threads", type=positive_int, default=1)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    device = _join(args.rank, args.world_size, args.init, args.backend, args.threads)
    try:
        rows = time_allreduce(args.sizes, device, args.warmup, args.iterations, args.budget_seconds)
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    run_main(main)

"""A scaling model of DDP data-parallel training: predicted step time,
per-GPU throughput and scaling efficiency from 1 to 1,024 GPUs for each DDP
communication hook (none, fp16, bf16, powersgd), and why efficiency falls.

    python -m common.tools.scaling --step-ms 70 -a resnet50 -b 256          # one single-GPU step time
    python -m common.tools.scaling --run runs/<run-dir>                      # ... read from a run directory
    python -m common.tools.scaling --bench results/bench/<file>.csv          # ... or from a bench CSV
    python -m common.tools.scaling --preset upstream-v100-hal                # Validation A: the 2020 V100 runs
    python -m common.tools.scaling --preset h100-8x8                         # ResNet-50 on 64 H100s, with knobs

What it does, per GPU count N and hook:
  1. The model's gradients, from the model itself: torchvision's model is built on
     the meta device (no weights, no memory, nothing downloaded) and run forward
     and backward under torch.utils.flop_counter; a hook on each parameter records
     the backward FLOPs done when its gradient is ready. That order is the one DDP
     rebuilds its buckets in after the first step.
  2. DDP's buckets (torch 2.14): filled in that order, a bucket closes once it holds
     at least its cap: 1 MiB for the first (dist._DEFAULT_FIRST_BUCKET_BYTES) and
     25 MiB after it with DDP's default bucket_cap_mb; a bucket_cap_mb given to
     DDP is the cap of every bucket, the first included.
  3. Time: the measured single-device step, less data wait, is forward + backward
     (split by their FLOPs) + the optimizer step (--optimizer-ms, default 0: inside
     forward+backward). A bucket is ready when backward has done the FLOPs of every
     layer after it; one communication stream all-reduces the buckets in order,
     each when ready and when the one before it is done. Exposed communication =
     max(0, end of the last all-reduce - end of backward).
  4. All-reduce (ring, the nccl-tests busbw definition busbw = algbw * 2(n-1)/n):
     2(n-1)/n * S / busbw + latency, with 2(n-1) latency steps: all on NVLink
     within one node; across nodes, 2(nodes-1) of them cross the network and
     the rest stay inside nodes (NCCL's own cost model, src/graph/tuning.cc),
     and the bandwidth is each node's network link (a ring's traffic leaves
     each node through it). Rings are pessimistic at large N for small buckets:
     NCCL switches to trees there (log N latency); this model does not.
  5. Data: a constant wait per step (--data-wait-ms, measured), and optionally a
     supply ceiling: the loader's images/s per GPU (--loader-images-per-second)
     and the shared file system's read bandwidth for all N GPUs together
     (--storage-gbps, --image-bytes). Loading overlaps the step; the step takes
     the longer of the two.

Hooks (what crosses the wire per bucket): none: the fp32 gradients (4 bytes each);
fp16/bf16: 2 bytes each (the casts' time is left out: a few element-wise passes
over the bucket); powersgd (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook,
after start_powerSGD_iter, default 1000 steps, before which it is the plain
all-reduce): each gradient viewed as a (shape[0], rest) matrix n x m is sent as
P (n x r) and Q (m x r) when (n + m) r * min_compression_rate < n m, else with the
vectors uncompressed; three all-reduces in sequence per bucket (the uncompressed
tensors, all Ps, all Qs), fp32; the compression's matrix products are left out.

Units are in names: _ms milliseconds, _bytes bytes, _gbps gigabits per second.
The CSV goes to results/scaling/ (an existing file is never replaced without
--overwrite); the figure (derived, redrawn each time) to figures/scaling_model.png.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from common.arguments import Parser, non_negative_float, positive_float, positive_int
from common.config import DDP_COMM_HOOKS as HOOKS
from common.errors import UsageError, error_summary, run_main
from common.files import MIB, atomic_write_text
from common.tools import plots

DDP_DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DDP_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_GPUS = tuple(2 ** power for power in range(11))  # 1 .. 1024
# NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc, 2020): Ring/Simple latency per step.
NCCL_RING_NVLINK_LATENCY_US = 3.4
NCCL_RING_NETWORK_LATENCY_US = 9.6
# ImageNet-1k's training set: 1,281,167 JPEGs in ~138 GB (ILSVRC2012_img_train.tar, 147,897,477,120 bytes).
IMAGENET_MEAN_IMAGE_BYTES = 115_000
CSV_COLUMNS = ["scenario", "hook", "gpus", "nodes", "arch", "batch_size", "accumulation_steps", "buckets",
               "comm_bytes_per_step", "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "data_wait_ms",
               "images_per_second_per_gpu", "images_per_second", "efficiency_percent",
               "measured_efficiency_percent", "difference_pp"]
REPO = Path(__file__).resolve().parents[2]


# --- the model's gradients and DDP's buckets --------------------------------------------------------------

@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient, in the order backward produces them."""

    name: str
    shape: Tuple[int, ...]
    element_bytes: int  # of the parameter (DDP's bucket holds gradients in the parameter's dtype)
    ready_fraction: float  # share of the backward pass's FLOPs done when this gradient is ready

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.numel * self.element_bytes


@dataclass(frozen=True)
class ModelProfile:
    arch: str
    image_size: int
    forward_flops_per_image: float
    backward_flops_per_image: float
    gradients: Tuple[Gradient, ...]

    @property
    def backward_share(self) -> float:
        """Backward's share of forward + backward FLOPs (about 2/3)."""
        return self.backward_flops_per_image / (self.forward_flops_per_image + self.backward_flops_per_image)


def profile_model(arch: str, image_size: int = 224, num_classes: int = 1000) -> ModelProfile:
    """Trace `arch` forward and backward on the meta device (shapes only:
    nothing computed, no weights downloaded) under FlopCounterMode; each
    parameter's post-accumulate-grad hook records the backward FLOPs done when
    its gradient is ready. Two images: BatchNorm wants more than one value per
    channel in training; the shares do not depend on the batch."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    images = 2
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
            inputs = torch.empty(images, 3, image_size, image_size)
            target = torch.zeros(images, dtype=torch.long)
    except ValueError as error:
        raise UsageError(f"argument -a/--arch: {arch!r} is not a torchvision model ({error_summary(error)})") from None
    model.train()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    counter = FlopCounterMode(display=False)
    ready: List[Tuple[int, int]] = []  # (parameter index, total FLOPs counted when its gradient was ready)
    handles = [p.register_post_accumulate_grad_hook(lambda _, index=i: ready.append((index, counter.get_total_flops())))
               for i, (_, p) in enumerate(named)]
    try:
        with counter:
            output = model(inputs)
            output = output.logits if hasattr(output, "logits") else output  # inception/googlenet in training
            loss = torch.nn.functional.cross_entropy(output, target)
            forward_flops = counter.get_total_flops()
            loss.backward()
            total_flops = counter.get_total_flops()
    except Exception as error:  # an image size the model cannot take, an op without a meta version
        raise UsageError(f"argument --image-size: cannot trace {arch} at {image_size} px on the meta device "
                         f"({error_summary(error)})") from None
    finally:
        for handle in handles:
            handle.remove()
    backward_flops = max(total_flops - forward_flops, 1)
    seen = set()
    gradients = []
    for index, flops in ready:
        if index in seen:  # a parameter used twice accumulates twice: DDP marks it ready once, the first time
            continue
        seen.add(index)
        name, parameter = named[index]
        gradients.append(Gradient(name, tuple(parameter.shape), parameter.element_size(),
                                  (flops - forward_flops) / backward_flops))
    return ModelProfile(arch, image_size, forward_flops / images, backward_flops / images, tuple(gradients))


def ddp_bucket_caps(bucket_cap_mb: Optional[float]) -> Tuple[int, int]:
    """(first bucket's cap, every other bucket's cap) in bytes, as torch 2.14's
    DDP sets them (_BucketCapacityConfig): the 1 MiB first bucket only when
    bucket_cap_mb is left at its default."""
    if bucket_cap_mb is None:
        return DDP_FIRST_BUCKET_BYTES, DDP_DEFAULT_BUCKET_CAP_MB * MIB
    cap = int(bucket_cap_mb * MIB) if math.isfinite(bucket_cap_mb) else sys.maxsize
    return cap, cap


@dataclass(frozen=True)
class Bucket:
    gradients: Tuple[Gradient, ...]

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.gradients)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.gradients)

    @property
    def ready_fraction(self) -> float:
        """A bucket is all-reduced once its last gradient is ready."""
        return max(g.ready_fraction for g in self.gradients)


def assign_buckets(gradients: Sequence[Gradient], first_cap_bytes: int, cap_bytes: int) -> List[Bucket]:
    """DDP's bucket assignment (c10d compute_bucket_assignment_by_size): in
    gradient-ready order, a tensor joins the open bucket, and the bucket closes
    once it holds at least its cap (so a bucket can exceed it by one tensor).
    All gradients here share one dtype and device; DDP would keep one open bucket per dtype."""
    buckets, current, size = [], [], 0
    for gradient in gradients:
        current.append(gradient)
        size += gradient.bytes
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(Bucket(tuple(current)))
            current, size = [], 0
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


def collective_bytes(bucket: Bucket, hook: str, powersgd_rank: int = 1, min_compression_rate: float = 2.0) -> List[int]:
    """Bytes of each all-reduce one bucket needs under `hook`, in the order they run."""
    if hook == "none":
        return [bucket.bytes]
    if hook in ("fp16", "bf16"):
        return [bucket.numel * 2]
    if hook != "powersgd":
        raise ValueError(hook)
    uncompressed = p_elements = q_elements = 0
    for gradient in bucket.gradients:
        rows = gradient.shape[0] if gradient.shape else 1
        columns = gradient.numel // rows
        rank = min(rows, columns, powersgd_rank)
        if (rows + columns) * rank * min_compression_rate < rows * columns:  # powerSGD_hook._should_compress
            p_elements += rows * rank
            q_elements += columns * rank
        else:
            uncompressed += gradient.numel
    # The hook all-reduces the uncompressed tensors, then all Ps, then all Qs, each in the bucket's dtype.
    element_bytes = bucket.gradients[0].element_bytes
    return [count * element_bytes for count in (uncompressed, p_elements, q_elements) if count]


# --- links and all-reduce time ------------------------------------------------------------------------------

def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: a ring's 2(n-1) steps each move
    size/n, so each link carries 2(n-1)/n of the size; algbw (size / time)
    counts it once. In bytes/s or any unit algbw is given in."""
    return algbw * 2 * (world_size - 1) / world_size


def ring_allreduce_ms(size_bytes: float, ranks: int, busbw_bytes_per_second: float, latency_seconds: float) -> float:
    """Ring all-reduce of `size_bytes` over `ranks`: 2(n-1)/n * S / busbw + 2(n-1) * latency."""
    if ranks <= 1:
        return 0.0
    return 1000.0 * (2 * (ranks - 1) / ranks * size_bytes / busbw_bytes_per_second + 2 * (ranks - 1) * latency_seconds)


@dataclass(frozen=True)
class Links:
    """The interconnect. Bandwidths in bytes/s (bus bandwidth, nccl-tests'
    definition), latencies in seconds per ring step."""

    gpus_per_node: int
    intra_node_bytes_per_second: float
    intra_node_latency_seconds: float
    inter_node_bytes_per_second: float  # each node's network link, all its NICs together
    inter_node_latency_seconds: float

    def nodes(self, gpus: int) -> int:
        return math.ceil(gpus / self.gpus_per_node)

    def allreduce_ms(self, size_bytes: float, gpus: int) -> float:
        if gpus <= 1 or size_bytes <= 0:
            return 0.0
        nodes = self.nodes(gpus)
        if nodes == 1:
            return ring_allreduce_ms(size_bytes, gpus, self.intra_node_bytes_per_second,
                                     self.intra_node_latency_seconds)
        # One ring over all GPUs: every hop carries the same bytes, so the slowest link sets the pace;
        # of its 2(n-1) steps, 2(nodes-1) cross the network (NCCL's tuning model does the same split).
        busbw = min(self.inter_node_bytes_per_second, self.intra_node_bytes_per_second)
        steps, network_steps = 2 * (gpus - 1), 2 * (nodes - 1)
        latency = (steps - network_steps) * self.intra_node_latency_seconds + \
            network_steps * self.inter_node_latency_seconds
        return ring_allreduce_ms(size_bytes, gpus, busbw, 0.0) + 1000.0 * latency


def gbps_to_bytes(gigabits_per_second: float) -> float:
    return gigabits_per_second * 1e9 / 8


# --- the step ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPrediction:
    gpus: int
    step_ms: float  # per micro-batch step (an optimizer step over accumulation_steps micro-batches / that count)
    compute_ms: float
    comm_ms: float  # the communication stream's busy time
    exposed_comm_ms: float
    data_wait_ms: float
    comm_bytes: int  # sent through all-reduces per optimizer step (the payload S of each, summed)


@dataclass(frozen=True)
class Settings:
    """Everything one prediction needs; a preset is a list of these."""

    arch: str = "resnet50"
    image_size: int = 224
    num_classes: int = 1000
    batch_size: int = 256
    step_ms: float = 70.0  # measured step time at measured_gpus, data wait included
    data_wait_ms: float = 0.0  # of step_ms, waiting for input
    measured_gpus: int = 1
    measured_hook: str = "none"  # how the measured run communicated (it matters when measured_gpus > 1)
    gpus: Tuple[int, ...] = DEFAULT_GPUS
    baseline_gpus: Optional[int] = None  # efficiency's 100%: default the smallest of gpus
    hooks: Tuple[str, ...] = HOOKS
    bucket_cap_mb: Optional[float] = None  # None: DDP's default (25 MiB, first bucket 1 MiB); inf: one bucket
    overlap: bool = True  # False: every all-reduce after backward (Apex DDP delay_allreduce=True)
    accumulation_steps: int = 1
    optimizer_ms: float = 0.0
    powersgd_rank: int = 1
    powersgd_min_compression_rate: float = 2.0
    links: Links = Links(8, 450e9, NCCL_RING_NVLINK_LATENCY_US * 1e-6, gbps_to_bytes(8 * 400),
                         NCCL_RING_NETWORK_LATENCY_US * 1e-6)
    loader_images_per_second: Optional[float] = None  # per GPU, the input pipeline's ceiling
    storage_gbps: Optional[float] = None  # the shared file system's read bandwidth, all nodes together
    image_bytes: float = IMAGENET_MEAN_IMAGE_BYTES
    scenario: str = "as given"


def predict_step(settings: Settings, profile: ModelProfile, buckets: Sequence[Bucket], hook: str, gpus: int,
                 compute_ms: float) -> StepPrediction:
    """One optimizer step at `gpus` GPUs, given forward+backward time `compute_ms` per micro-batch."""
    steps = settings.accumulation_steps
    backward_ms = compute_ms * profile.backward_share
    forward_ms = compute_ms - backward_ms
    # Micro-batches before the last run under no_sync(): no communication. The last one's backward overlaps it.
    last_backward_start = (steps - 1) * compute_ms + forward_ms
    backward_end = steps * compute_ms
    stream_free = last_backward_start
    comm_ms = 0.0
    comm_bytes = 0
    for bucket in buckets:
        sizes = collective_bytes(bucket, hook, settings.powersgd_rank, settings.powersgd_min_compression_rate)
        duration = sum(settings.links.allreduce_ms(size, gpus) for size in sizes) if gpus > 1 else 0.0
        ready = last_backward_start + bucket.ready_fraction * backward_ms if settings.overlap else backward_end
        stream_free = max(stream_free, ready) + duration
        comm_ms += duration
        comm_bytes += sum(sizes) if gpus > 1 else 0
    exposed = max(0.0, stream_free - backward_end)
    busy = backward_end + exposed + settings.optimizer_ms
    # Data: the measured wait per micro-batch, or the supply ceiling if that is slower than the whole step.
    images = steps * settings.batch_size
    supply_ms = 0.0
    if settings.loader_images_per_second:
        supply_ms = max(supply_ms, 1000.0 * images / settings.loader_images_per_second)
    if settings.storage_gbps:
        supply_ms = max(supply_ms, 1000.0 * gpus * images * settings.image_bytes / gbps_to_bytes(settings.storage_gbps))
    total = max(busy + steps * settings.data_wait_ms, supply_ms)
    return StepPrediction(gpus, total / steps, (steps * compute_ms + settings.optimizer_ms) / steps,
                          comm_ms / steps, exposed / steps, (total - busy) / steps, comm_bytes)


def solve_compute_ms(settings: Settings, profile: ModelProfile, buckets: Sequence[Bucket]) -> float:
    """Forward+backward time per micro-batch such that the model reproduces the
    measured step at measured_gpus (the communication the model predicts there
    comes off the measured time). Bisection: the step grows with compute."""
    measured = replace(settings, accumulation_steps=1, loader_images_per_second=None, storage_gbps=None)
    target = settings.step_ms - settings.data_wait_ms - settings.optimizer_ms
    if target <= 0:
        raise UsageError(f"argument --data-wait-ms: {settings.data_wait_ms:g} ms (plus --optimizer-ms "
                         f"{settings.optimizer_ms:g}) leaves no compute in a {settings.step_ms:g} ms step")
    low, high = 0.0, target
    for _ in range(60):
        middle = (low + high) / 2
        predicted = predict_step(measured, profile, buckets, settings.measured_hook, settings.measured_gpus, middle)
        if predicted.step_ms - settings.data_wait_ms - settings.optimizer_ms > target:
            high = middle
        else:
            low = middle
    return low


def predict(settings: Settings, profile: ModelProfile) -> List[dict]:
    """The table: one row per hook and GPU count."""
    buckets = assign_buckets(profile.gradients, *ddp_bucket_caps(settings.bucket_cap_mb))
    compute_ms = solve_compute_ms(settings, profile, buckets)
    baseline = settings.baseline_gpus or min(settings.gpus)
    rows = []
    for hook in settings.hooks:
        predictions = {gpus: predict_step(settings, profile, buckets, hook, gpus, compute_ms)
                       for gpus in sorted(set(settings.gpus) | {baseline})}
        base_rate = settings.batch_size / predictions[baseline].step_ms
        for gpus in settings.gpus:
            p = predictions[gpus]
            per_gpu = 1000.0 * settings.batch_size / p.step_ms
            rows.append({"scenario": settings.scenario, "hook": hook, "gpus": gpus,
                         "nodes": settings.links.nodes(gpus), "arch": settings.arch,
                         "batch_size": settings.batch_size, "accumulation_steps": settings.accumulation_steps,
                         "buckets": len(buckets), "comm_bytes_per_step": p.comm_bytes, "step_ms": p.step_ms,
                         "compute_ms": p.compute_ms, "comm_ms": p.comm_ms, "exposed_comm_ms": p.exposed_comm_ms,
                         "data_wait_ms": p.data_wait_ms, "images_per_second_per_gpu": per_gpu,
                         "images_per_second": per_gpu * gpus,
                         "efficiency_percent": 100.0 * (settings.batch_size / p.step_ms) / base_rate,
                         "measured_efficiency_percent": math.nan, "difference_pp": math.nan})
    return rows


# --- inputs: run directories, bench CSVs, comm CSVs --------------------------------------------------------

def settings_from_run(path: Path, settings: Settings) -> Settings:
    """Step time and data wait from a run directory's metrics.csv (mean over its
    training epochs), and arch, batch, image size and world size from config.json."""
    if not path.is_dir():
        raise UsageError(f"argument --run: {path}: no such run directory")
    run = plots.read_run_dir(path)
    if run is None or run.epochs["seconds_per_step"].dropna().empty:
        raise UsageError(f"argument --run: {path}: no finished training epoch in metrics.csv")
    options = (run.config or {}).get("options") or {}
    step_ms = 1000.0 * float(run.epochs["seconds_per_step"].mean())
    wait = run.epochs["data_wait_fraction"].dropna()
    return replace(settings, step_ms=step_ms, data_wait_ms=step_ms * float(wait.mean()) if len(wait) else 0.0,
                   measured_gpus=run.replicas, arch=options.get("arch", settings.arch),
                   batch_size=int(options.get("batch_size", settings.batch_size)),
                   image_size=int(options.get("image_size", settings.image_size)))


def _read_csv(path: Path, flag: str) -> List[dict]:
    if not path.is_file():
        raise UsageError(f"argument {flag}: {path}: no such file")
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    except (OSError, csv.Error, UnicodeDecodeError) as error:
        raise UsageError(f"argument {flag}: {path}: not a readable CSV ({error_summary(error)})") from None


def _number(row: dict, *columns: str) -> Optional[float]:
    for column in columns:
        try:
            value = float(row.get(column) or "nan")
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return None


def settings_from_bench(path: Path, config: Optional[str], settings: Settings) -> Settings:
    """ms_per_step, batch_size, arch, image_size of a bench CSV row (common.tools.bench):
    the first training row (section train or end-to-end) of --arch, or of --bench-config.
    A synthetic-data row has no data wait; a real-data row's wait is inside its step time."""
    rows = [row for row in _read_csv(path, "--bench")
            if row.get("section", "train") in ("train", "end-to-end") and _number(row, "ms_per_step")]
    rows = [row for row in rows if (config is None or row.get("config") == config)]
    if not rows:
        raise UsageError(f"argument --bench: {path}: no training row with ms_per_step"
                         + (f" and config {config!r}" if config else ""))
    row = rows[0]
    return replace(settings, step_ms=_number(row, "ms_per_step"), data_wait_ms=0.0, measured_gpus=1,
                   arch=row.get("arch") or settings.arch,
                   batch_size=int(_number(row, "batch_size") or settings.batch_size),
                   image_size=int(_number(row, "image_size") or settings.image_size))


def links_from_comm_csv(path: Path, links: Links) -> Links:
    """Bandwidths and latencies from a measured all-reduce CSV (a future bench
    "comm" section; tolerant of how it names things). Rows: section=comm when a
    section column exists. Size: bytes | size_bytes | size. Bus bandwidth:
    busbw_GBps | busbw_gbytes_per_s | "busbw (GB/s)" in GB/s, or busbw_gbps in Gbit/s.
    Time: latency_us | time_us. Scope: a scope column (intra/inter), else nodes > 1
    is inter-node. Bandwidth: the largest size's busbw; latency per ring step:
    the smallest size's time / (2(n-1)) when a ranks | world_size | gpus column
    gives n, else taken as per step."""
    rows = [row for row in _read_csv(path, "--comm-csv") if row.get("section", "comm") == "comm"]
    found: Dict[str, Dict[str, float]] = {}
    for row in rows:
        size = _number(row, "bytes", "size_bytes", "size")
        gbytes = _number(row, "busbw_GBps", "busbw_gbytes_per_s", "busbw (GB/s)")
        if gbytes is None and _number(row, "busbw_gbps") is not None:
            gbytes = _number(row, "busbw_gbps") / 8
        if size is None or gbytes is None:
            continue
        scope = (row.get("scope") or "").strip().lower()
        scope = scope if scope in ("intra", "inter") else "inter" if (_number(row, "nodes") or 1) > 1 else "intra"
        entry = found.setdefault(scope, {"largest": -1.0, "smallest": math.inf})
        if size > entry["largest"]:
            entry.update(largest=size, bytes_per_second=gbytes * 1e9)
        time_us = _number(row, "latency_us", "time_us")
        if time_us is not None and size < entry["smallest"]:
            ranks = _number(row, "ranks", "world_size", "gpus")
            entry.update(smallest=size, latency=time_us * 1e-6 / (2 * (ranks - 1) if ranks and ranks > 1 else 1))
    if not found:
        raise UsageError(f"argument --comm-csv: {path}: no comm rows with a size (bytes) and a bus bandwidth "
                         f"(busbw_GBps or busbw_gbps)")
    intra, inter = found.get("intra", {}), found.get("inter", {})
    return replace(links,
                   intra_node_bytes_per_second=intra.get("bytes_per_second", links.intra_node_bytes_per_second),
                   intra_node_latency_seconds=intra.get("latency", links.intra_node_latency_seconds),
                   inter_node_bytes_per_second=inter.get("bytes_per_second", links.inter_node_bytes_per_second),
                   inter_node_latency_seconds=inter.get("latency", links.inter_node_latency_seconds))


def measured_efficiencies(paths: Sequence[Path], device_kind: str = "gpu") -> Dict[str, Dict[int, float]]:
    """{series: {GPU count: measured scaling efficiency %}} from logs, as
    common.tools.plots defines it (per-GPU images/s over the smallest count's);
    only series with several counts, of the given device kind."""
    existing = [path for path in paths if path.exists()]
    if not existing:
        return {}
    try:
        table = plots.summarize(plots.load(existing).runs)
    except UsageError:  # folders without any run yet
        return {}
    found = {}
    for series, rows in table.groupby("series"):
        rows = rows.dropna(subset=["scaling_efficiency_percent"])
        if len(rows) >= 2 and set(rows["device_kind"]) == {device_kind}:
            found[series] = dict(zip(rows["gpus"].astype(int), rows["scaling_efficiency_percent"].astype(float)))
    return found


# --- presets: the validation against measured runs, and the H100 prediction ------------------------------

UPSTREAM = REPO / "results" / "upstream"
UPSTREAM_STORAGE_LOG = UPSTREAM / "IO" / "bandwidth_gpux64_cpu20_feb.csv"
# HAL (NCSA): 16 IBM AC922 nodes (POWER9), 4 V100-SXM2 16 GB each on NVLink 2.0, Mellanox EDR InfiniBand,
# a DDN all-flash array: Kindratenko et al., "HAL: Computer System for Scalable Deep Learning", PEARC 2020,
# https://experts.illinois.edu/en/publications/hal-computer-system-for-scalable-deep-learning
# EDR: 100 Gbit/s a port (one port a node assumed; an AC922 can hold two). AC922's NVLink 2.0 in its 4-GPU
# form: 3 bricks of 25 GB/s (each way) between a socket's two GPUs and its CPU, 75 GB/s (IBM Redpaper
# REDP-5472, "IBM Power System AC922 Introduction and Technical Overview").
HAL_LINKS = Links(4, 75e9, NCCL_RING_NVLINK_LATENCY_US * 1e-6, gbps_to_bytes(100), NCCL_RING_NETWORK_LATENCY_US * 1e-6)
# H100 nodes: 8 GPUs on NVLink 4 / NVSwitch (~450 GB/s all-reduce busbw inside a node, nccl-tests on
# DGX/HGX H100), 8 x 400 Gbit/s InfiniBand NDR a node (DGX H100: one ConnectX-7 per GPU).
H100_LINKS = Links(8, 450e9, NCCL_RING_NVLINK_LATENCY_US * 1e-6, gbps_to_bytes(8 * 400),
                   NCCL_RING_NETWORK_LATENCY_US * 1e-6)
# One H100's ResNet-50 step, 256 images, AMP O2 channels_last, synthetic data: 70 ms, from this project's
# results/bench/gpu_h200_2026-11-26_end-to-end.csv (H200: 66.94 ms; H100 and H200 share the compute,
# the H100 has less memory bandwidth); results/bench/gpu_h100_2026-11-24_2_amp-compile-input.csv
# measured 83.71 ms on an H100 with an older stack.
H100_STEP_MS = 70.0
# That H100 machine's input pipeline alone (torchvision decode, 12 workers): 2907 images/s
# (results/bench/gpu_h100_2026-11-24_2_amp-compile-input.csv, section input): slower than the GPU.
H100_LOADER_12_WORKERS = 2907.26


def upstream_settings() -> Settings:
    """The 2020 runs (results/upstream): ResNet-50, 208 per GPU, Apex O2 (fp16 gradients), Apex
    DistributedDataParallel(delay_allreduce=True): one flat all-reduce after backward, no overlap (read in
    github.com/richardkxu/distributed-pytorch imagenet_ddp_apex.py, every version). The compute time comes
    from the smallest run (2 GPUs): its mean Time/train (data loading included: not logged apart)."""
    runs = [run for run in plots.load([UPSTREAM]).runs if run.epochs["seconds_per_step"].notna().any()]
    smallest = min(runs, key=lambda run: run.replicas)
    return Settings(arch="resnet50", batch_size=208, step_ms=1000.0 * float(smallest.epochs["seconds_per_step"].mean()),
                    measured_gpus=smallest.replicas, measured_hook="fp16", gpus=(2, 4, 8, 16, 32, 64),
                    baseline_gpus=smallest.replicas, bucket_cap_mb=math.inf, overlap=False, links=HAL_LINKS,
                    scenario="HAL as published (EDR 100 Gbit/s, NVLink 2.0), no overlap")


def _storage_peak_gbps() -> float:
    """The highest read rate of the shared file system in the 64-GPU run's storage log, Gbit/s."""
    with open(UPSTREAM_STORAGE_LOG, newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter=";"))
    return max(float(row["Read"]) for row in rows) * 8 / 1e9


def preset(name: str) -> Tuple[List[Settings], List[Path]]:
    """(scenarios, measured log folders) of a preset."""
    if name == "upstream-v100-hal":
        base = upstream_settings()
        storage = _storage_peak_gbps()
        return [base,
                replace(base, storage_gbps=storage,
                        scenario=f"+ storage ceiling {storage / 8:.2f} GB/s (peak read in the 64-GPU run's own "
                                 f"storage log: explains, does not predict)")], [UPSTREAM]
    if name == "h100-8x8":
        base = Settings(arch="resnet50", batch_size=256, step_ms=H100_STEP_MS, links=H100_LINKS,
                        scenario="DDP defaults (bucket 25 MiB)")
        return [base,
                replace(base, bucket_cap_mb=100, scenario="bucket_cap_mb=100"),
                replace(base, accumulation_steps=2, scenario="accumulation 2 steps"),
                replace(base, accumulation_steps=4, scenario="accumulation 4 steps"),
                replace(base, loader_images_per_second=H100_LOADER_12_WORKERS,
                        scenario="real data, 12 loader workers/GPU (2907 images/s measured)"),
                replace(base, loader_images_per_second=H100_LOADER_12_WORKERS * 16 / 12,
                        scenario="real data, 16 loader workers/GPU (scaled from 12)")], [REPO / "results" / "runs"]
    raise UsageError(f"argument --preset: unknown preset {name!r} (choose from upstream-v100-hal, h100-8x8)")


PRESETS = ("upstream-v100-hal", "h100-8x8")


def attach_measured(rows: List[dict], measured: Dict[str, Dict[int, float]], hook: str) -> None:
    """Measured efficiency and the difference (pp) on the rows of `hook`, when one series was measured."""
    if len(measured) != 1:
        return
    (points,) = measured.values()
    for row in rows:
        if row["hook"] == hook and row["gpus"] in points:
            row["measured_efficiency_percent"] = points[row["gpus"]]
            row["difference_pp"] = row["efficiency_percent"] - points[row["gpus"]]


# --- outputs -------------------------------------------------------------------------------------------------

def write_csv_new(path: Path, rows: Sequence[dict], overwrite: bool) -> None:
    """Atomically (files.atomic_write_text): a temporary file beside it,
    flushed, then renamed into place, or, unless `overwrite`, linked into
    place, which fails if the name exists (another writer in between):
    nothing already written is replaced."""
    exists = f"argument --out: {path}: exists; nothing written (choose another --out, or --overwrite)"
    if path.exists() and not overwrite:
        raise UsageError(exists)

    def write(handle) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f"{value:.4g}" if isinstance(value, float) and math.isfinite(value)
                                   else "" if isinstance(value, float) else value) for key, value in row.items()})

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"argument --out: {path}: cannot write ({error_summary(error)})") from None
    try:
        atomic_write_text(path, write, overwrite=overwrite)
    except FileExistsError:
        raise UsageError(exists) from None
    except OSError as error:
        raise UsageError(f"argument --out: {path}: cannot write ({error_summary(error)})") from None


def draw_figure(panels: Sequence[Tuple[str, List[dict], Dict[str, Dict[int, float]], str]], path: Path,
                validation: Optional[List[dict]] = None) -> None:
    """Predicted efficiency per hook vs GPUs (log2 x axis), one panel per table
    (title, rows, measured points, the hook the scenarios are drawn with);
    measured points on top. Scenarios after the first are drawn dashed, for
    one hook only (so the panel stays readable); hooks with the same curve
    (fp16 and bf16 send the same bytes) share a line. `validation`: Validation
    B's rows (common.tools.link_validation), a last panel of measured and
    predicted step times on this machine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels) + bool(validation)
    fig, axes = plt.subplots(1, count, figsize=(7.5 * count, 5.5), squeeze=False)
    if validation:
        _draw_validation(axes[0][-1], validation)
    for ax, (title, rows, measured, scenario_hook) in zip(axes[0], panels):
        scenarios = list(dict.fromkeys(row["scenario"] for row in rows))
        curves: Dict[Tuple, List[str]] = {}  # one line per distinct curve, named by every hook that has it
        for hook in dict.fromkeys(row["hook"] for row in rows):
            points = tuple((r["gpus"], round(r["efficiency_percent"], 6)) for r in rows
                           if r["hook"] == hook and r["scenario"] == scenarios[0])
            curves.setdefault(points, []).append(hook)
        for index, (points, hooks) in enumerate(curves.items()):
            ax.plot(*zip(*points), "-", color=f"C{index}", label=f"predicted, hook {' = '.join(hooks)}")
        for offset, scenario in enumerate(scenarios[1:], start=1):
            points = [(r["gpus"], r["efficiency_percent"]) for r in rows
                      if r["hook"] == scenario_hook and r["scenario"] == scenario]
            ax.plot(*zip(*points), "--", color=f"C{len(curves) + offset}", label=f"{scenario} ({scenario_hook})")
        for offset, (series, values) in enumerate(measured.items()):
            counts = sorted(values)
            ax.plot(counts, [values[c] for c in counts], "o", color="black" if offset == 0 else f"C{9 - offset}",
                    markersize=7, label=f"measured: {series}")
            for count in counts:
                ax.annotate(f"{values[count]:.0f}%", (count, values[count]), textcoords="offset points",
                            xytext=(0, -13), ha="center", fontsize=8)
        if not measured:
            ax.text(0.98, 0.97, "no measured GPU runs of several counts to compare", transform=ax.transAxes,
                    ha="right", va="top", fontsize=8, color="0.35")
        counts = sorted({row["gpus"] for row in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.axhline(100, color="0.6", linestyle=":", linewidth=1)
        ax.set(xlabel="GPUs", ylabel="scaling efficiency (%)", ylim=(0, 110), title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.text(0.01, 0.005, "Model: python -m common.tools.scaling (DDP buckets from the model, ring all-reduce, "
             "overlap with backward by FLOPs). Measured: per-GPU images/s over the smallest run's.",
             fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _draw_validation(ax, rows: List[dict]) -> None:
    """Validation B: per link and hook, the measured step (dot) against the
    model's (cross), and the step without communication (the bars' floor)."""
    labels = [f"{row['link']}\n{row['hook']}" for row in rows]
    positions = range(len(rows))
    ax.bar(positions, [float(row["compute_ms"]) for row in rows], color="0.85", label="compute (no communication)")
    ax.plot(positions, [float(row["measured_ms"]) for row in rows], "o", color="black", markersize=8,
            label="measured step")
    ax.plot(positions, [float(row["predicted_ms"]) for row in rows], "x", color="C3", markersize=10, mew=2,
            label="predicted step")
    for position, row in zip(positions, rows):
        ax.annotate(f"{float(row['difference_percent']):+.1f}%", (position, float(row["measured_ms"])),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xticks(list(positions), labels)
    ax.set(ylabel="ms per step", title=f"Validation B: 2 CPU processes over a tc-limited veth, "
                                       f"{rows[0]['arch']} b{rows[0]['batch_size']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right")


def summary_lines(rows: Sequence[dict], gpus: int) -> List[str]:
    """A plain-text table at one GPU count: every scenario and hook."""
    lines = [f"{'scenario':<62} {'hook':<9} {'step_ms':>8} {'exposed_comm_ms':>15} {'data_wait_ms':>12} "
             f"{'img/s/GPU':>9} {'eff_%':>6}"]
    for row in rows:
        if row["gpus"] == gpus:
            lines.append(f"{row['scenario'][:62]:<62} {row['hook']:<9} {row['step_ms']:8.1f} "
                         f"{row['exposed_comm_ms']:15.2f} {row['data_wait_ms']:12.1f} "
                         f"{row['images_per_second_per_gpu']:9.0f} {row['efficiency_percent']:6.1f}")
    return lines


# --- command line -------------------------------------------------------------------------------------------

def gpu_list(text: str) -> Tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts like 1,2,4,8, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive GPU counts, got {text!r}")
    return tuple(sorted(set(counts)))


def bucket_cap(text: str) -> float:
    if text.lower() in ("inf", "one"):
        return math.inf
    return positive_float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.scaling", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    what = parser.add_argument_group("what to predict")
    what.add_argument("--preset", action="append", choices=PRESETS, default=None,
                      help="upstream-v100-hal: Validation A against results/upstream; h100-8x8: ResNet-50 on "
                           "H100 nodes with each knob. Repeat for several (one figure panel each)")
    what.add_argument("-a", "--arch", default="resnet50", help="torchvision model (default resnet50)")
    what.add_argument("--image-size", type=positive_int, default=224)
    what.add_argument("--num-classes", type=positive_int, default=1000)
    what.add_argument("-b", "--batch-size", type=positive_int, default=256, help="per GPU")
    what.add_argument("--gpus", type=gpu_list, default=DEFAULT_GPUS, help="GPU counts (default 1,2,4,...,1024)")
    what.add_argument("--baseline-gpus", type=positive_int, default=None,
                      help="efficiency's 100%% (default: the smallest of --gpus)")
    what.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    measured = parser.add_argument_group("the measured step (one of)")
    measured.add_argument("--step-ms", type=positive_float, default=None,
                          help="measured step time, data wait included (default 70, an H100's ResNet-50 b256)")
    measured.add_argument("--data-wait-ms", type=non_negative_float, default=0.0, help="of --step-ms")
    measured.add_argument("--measured-gpus", type=positive_int, default=1, help="GPUs the step was measured on")
    measured.add_argument("--measured-hook", choices=HOOKS, default="none")
    measured.add_argument("--run", default=None, metavar="RUN_DIR", help="this project's run directory")
    measured.add_argument("--bench", default=None, metavar="CSV", help="a common.tools.bench CSV")
    measured.add_argument("--bench-config", default=None, metavar="NAME", help="the bench row's config column")
    ddp = parser.add_argument_group("DDP")
    ddp.add_argument("--bucket-cap-mb", type=bucket_cap, default=None,
                     help="DDP's bucket_cap_mb (default: DDP's 25 with a 1 MiB first bucket; 'inf': one bucket)")
    ddp.add_argument("--no-overlap", action="store_true", help="all-reduce after backward (Apex delay_allreduce)")
    ddp.add_argument("--accum-steps", dest="accumulation_steps", type=positive_int, default=1,
                     help="micro-batches per optimizer step (the scripts' --accum-steps): one exchange per step")
    ddp.add_argument("--optimizer-ms", type=non_negative_float, default=0.0)
    ddp.add_argument("--powersgd-rank", type=positive_int, default=1)
    ddp.add_argument("--powersgd-min-compression-rate", type=positive_float, default=2.0)
    links = parser.add_argument_group("interconnect (default: H100 nodes, 8 GPUs, NVLink 4, 8 x NDR 400)")
    links.add_argument("--gpus-per-node", type=positive_int, default=8)
    links.add_argument("--link-gbps", type=positive_float, default=3200.0,
                       help="inter-node bandwidth per node, Gbit/s, all NICs together")
    links.add_argument("--latency-us", type=non_negative_float, default=NCCL_RING_NETWORK_LATENCY_US,
                       help="per ring step across nodes (NCCL's model: 9.6)")
    links.add_argument("--intra-node-gbps", type=positive_float, default=3600.0,
                       help="all-reduce bus bandwidth inside a node, Gbit/s (3600 = 450 GB/s)")
    links.add_argument("--intra-node-latency-us", type=non_negative_float, default=NCCL_RING_NVLINK_LATENCY_US)
    links.add_argument("--comm-csv", default=None, metavar="CSV", help="measured all-reduce rows (overrides)")
    data = parser.add_argument_group("data supply")
    data.add_argument("--loader-images-per-second", type=positive_float, default=None, help="per GPU")
    data.add_argument("--storage-gbps", type=positive_float, default=None, help="shared file system, all nodes")
    data.add_argument("--image-bytes", type=positive_float, default=IMAGENET_MEAN_IMAGE_BYTES)
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, metavar="CSV", help="default results/scaling/<name>.csv")
    out.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    out.add_argument("--figure", default=str(REPO / "figures" / "scaling_model.png"), metavar="PNG")
    out.add_argument("--no-figure", action="store_true")
    out.add_argument("--validation", default=str(REPO / "results" / "scaling" / "validation-b.csv"), metavar="CSV",
                     help="Validation B's CSV (python -m common.tools.link_validation), a last panel of the figure "
                          "when the file exists")
    out.add_argument("--measured", nargs="*", default=None, metavar="LOG_DIR",
                     help="measured runs drawn on the figure (default results/runs: GPU series of several counts)")
    return parser


def settings_from_args(args) -> Settings:
    if sum(x is not None for x in (args.step_ms, args.run, args.bench)) > 1:
        raise UsageError("arguments --step-ms, --run, --bench: give one of them")
    links = Links(args.gpus_per_node, gbps_to_bytes(args.intra_node_gbps), args.intra_node_latency_us * 1e-6,
                  gbps_to_bytes(args.link_gbps), args.latency_us * 1e-6)
    if args.comm_csv:
        links = links_from_comm_csv(Path(args.comm_csv), links)
    settings = Settings(arch=args.arch, image_size=args.image_size, num_classes=args.num_classes,
                        batch_size=args.batch_size, step_ms=args.step_ms or H100_STEP_MS,
                        data_wait_ms=args.data_wait_ms, measured_gpus=args.measured_gpus,
                        measured_hook=args.measured_hook, gpus=args.gpus, baseline_gpus=args.baseline_gpus,
                        hooks=tuple(args.hooks), bucket_cap_mb=args.bucket_cap_mb, overlap=not args.no_overlap,
                        accumulation_steps=args.accumulation_steps, optimizer_ms=args.optimizer_ms,
                        powersgd_rank=args.powersgd_rank,
                        powersgd_min_compression_rate=args.powersgd_min_compression_rate, links=links,
                        loader_images_per_second=args.loader_images_per_second, storage_gbps=args.storage_gbps,
                        image_bytes=args.image_bytes)
    if args.step_ms is not None and args.data_wait_ms + args.optimizer_ms >= args.step_ms:
        raise UsageError(f"argument --data-wait-ms: {args.data_wait_ms:g} ms (plus --optimizer-ms "
                         f"{args.optimizer_ms:g}) leaves no compute in a {args.step_ms:g} ms step")
    if args.run:
        settings = settings_from_run(Path(args.run), settings)
    elif args.bench:
        settings = settings_from_bench(Path(args.bench), args.bench_config, settings)
    if settings.baseline_gpus is not None and settings.baseline_gpus not in settings.gpus:
        raise UsageError(f"argument --baseline-gpus: {settings.baseline_gpus} is not one of --gpus")
    return settings


def main(argv: Optional[Sequence[str]] = None) -> List[Path]:
    args = build_parser().parse_args(argv)
    if args.preset and args.out and len(args.preset) > 1:
        raise UsageError("argument --out: one file, but several --preset (leave --out out)")
    if args.preset:
        jobs = [(name, *preset(name)) for name in dict.fromkeys(args.preset)]
    else:
        settings = settings_from_args(args)
        name = f"{settings.arch}_b{settings.batch_size}_{settings.step_ms:g}ms"
        jobs = [(name, [settings], [Path(p) for p in args.measured] if args.measured is not None
                 else [REPO / "results" / "runs"])]
    outs = [Path(args.out) if args.out else REPO / "results" / "scaling" / f"{name}.csv" for name, _, _ in jobs]
    for path in outs:  # refuse before the slow part
        if path.exists() and not args.overwrite:
            raise UsageError(f"argument --out: {path}: exists; nothing written (choose another --out, or --overwrite)")
    written, panels = [], []
    profiles: Dict[Tuple[str, int, int], ModelProfile] = {}
    for (name, scenarios, measured_dirs), out in zip(jobs, outs):
        rows = []
        for settings in scenarios:
            key = (settings.arch, settings.image_size, settings.num_classes)
            if key not in profiles:
                print(f"tracing {settings.arch} at {settings.image_size} px on the meta device ...", file=sys.stderr)
                profiles[key] = profile_model(*key)
            rows += predict(settings, profiles[key])
        measured = measured_efficiencies(measured_dirs)
        # Measured runs are compared with the rows of the hook they communicated with.
        compared_hook = scenarios[0].measured_hook if scenarios[0].measured_gpus > 1 else scenarios[0].hooks[0]
        attach_measured(rows, measured, compared_hook)
        write_csv_new(out, rows, args.overwrite)
        written.append(out)
        profile = profiles[(scenarios[0].arch, scenarios[0].image_size, scenarios[0].num_classes)]
        buckets = assign_buckets(profile.gradients, *ddp_bucket_caps(scenarios[0].bucket_cap_mb))
        print(f"{name}: {scenarios[0].arch}, {sum(g.numel for g in profile.gradients):,} gradients in "
              f"{len(buckets)} bucket(s) of {', '.join(f'{b.bytes / MIB:.1f}' for b in buckets)} MiB; backward "
              f"{100 * profile.backward_share:.1f}% of the FLOPs; written {out}")
        shown = 64 if 64 in scenarios[0].gpus else max(scenarios[0].gpus)
        print("\n".join(summary_lines(rows, shown)))
        if any(math.isfinite(row["measured_efficiency_percent"]) for row in rows):
            print(f"{'gpus':>5} {'measured_%':>10} {'predicted_%':>11} {'difference_pp':>13}   ({rows[0]['scenario']})")
            for row in rows:
                if math.isfinite(row["measured_efficiency_percent"]) and row["scenario"] == scenarios[0].scenario:
                    print(f"{row['gpus']:>5} {row['measured_efficiency_percent']:10.1f} "
                          f"{row['efficiency_percent']:11.1f} {row['difference_pp']:13.1f}")
        panels.append((f"{name}: {scenarios[0].arch}, b{scenarios[0].batch_size}/GPU, "
                       f"{scenarios[0].links.gpus_per_node} GPUs/node", rows, measured, compared_hook))
    if not args.no_figure:
        validation = _read_csv(Path(args.validation), "--validation") if Path(args.validation).is_file() else None
        draw_figure(panels, Path(args.figure), validation)
        print(f"figure: {args.figure}")
        written.append(Path(args.figure))
    return written


if __name__ == "__main__":
    run_main(main)

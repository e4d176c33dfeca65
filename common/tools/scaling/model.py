"""The scaling model of DDP data-parallel training: a model's gradients, DDP's
buckets, the bytes each hook sends, ring all-reduce over the links, and the
step time they make at each GPU count (predict). No files, no command line:
common.tools.scaling.inputs reads what it is given, .command_line runs it.

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
     supply ceiling: the loader's images/s per GPU (--loader-images-per-second),
     the shared storage's read bandwidth for all nodes together (--storage-gbps,
     --image-bytes), one node's read bandwidth from it (--node-storage-gbps) and
     the files one node may open on it per second (--node-opens-per-second).
     Loading overlaps the step; the step takes the longer of the two. How the
     data is laid out (--data-layout) says what a step asks of the storage
     (supply_ms_by_epoch): files, one open per image; shards, the same bytes
     and no opens to speak of (one per shard and process); shards+cache, a
     node-local cache of whole shards: in the first epoch each node copies
     every shard (a full permutation reads from all of them on every node), so
     the source serves nodes x the bytes the GPUs consume, and the later
     epochs read the node's own disk (--cache-gbps); the step is the mean
     over --epochs; warm-cache, every epoch local (a requeued job).

Hooks (what crosses the wire per bucket): none: the fp32 gradients (4 bytes each);
fp16/bf16: 2 bytes each (the casts' time is left out: a few element-wise passes
over the bucket); powersgd (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook,
after start_powerSGD_iter, default 1000 steps, before which it is the plain
all-reduce): each gradient viewed as a (shape[0], rest) matrix n x m is sent as
P (n x r) and Q (m x r) when (n + m) r * min_compression_rate < n m, else with the
vectors uncompressed; three all-reduces in sequence per bucket (the uncompressed
tensors, all Ps, all Qs), fp32; the compression's matrix products are left out.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from common.config import DDP_COMM_HOOKS as HOOKS
from common.errors import UsageError, error_summary
from common.files import MIB

DDP_DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DDP_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_GPUS = tuple(2 ** power for power in range(11))  # 1 .. 1024
# NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc, 2020): Ring/Simple latency per step.
NCCL_RING_NVLINK_LATENCY_US = 3.4
NCCL_RING_NETWORK_LATENCY_US = 9.6
# --data-layout: what a step asks of the storage (supply_ms_by_epoch).
DATA_LAYOUTS = ("files", "shards", "shards+cache", "warm-cache")
# ImageNet-1k's training set: 1,281,167 JPEGs in ~138 GB (ILSVRC2012_img_train.tar, 147,897,477,120 bytes).
IMAGENET_MEAN_IMAGE_BYTES = 115_000


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
    node_storage_gbps: Optional[float] = None  # one node's read bandwidth from the shared storage
    node_opens_per_second: Optional[float] = None  # files one node may open per second on the shared storage
    data_layout: str = "files"  # DATA_LAYOUTS
    epochs: int = 90  # shards+cache: the first copies every shard to every node, the others read locally
    cache_gbps: Optional[float] = None  # one node's read bandwidth from its local cache (None: not limiting)
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
    # Data: the measured wait per micro-batch, or the supply ceiling if that is slower than the whole step; with a
    # node-local cache the first epoch's step and the later epochs' differ, and the step is their mean.
    first_ms, later_ms = supply_ms_by_epoch(settings, gpus, steps * settings.batch_size)
    waited = busy + steps * settings.data_wait_ms
    total = max(waited, later_ms)
    total += (max(waited, first_ms) - total) / settings.epochs  # 0 (exactly) unless the first epoch differs
    return StepPrediction(gpus, total / steps, (steps * compute_ms + settings.optimizer_ms) / steps,
                          comm_ms / steps, exposed / steps, (total - busy) / steps, comm_bytes)


def supply_ms_by_epoch(settings: Settings, gpus: int, images: int) -> Tuple[float, float]:
    """The time the data supply needs for one step of `images` per GPU at
    `gpus` GPUs, in the first epoch and in each later one (ms): the slowest
    of the loader, the shared storage's bandwidth (all nodes), a node's
    bandwidth and its opens per second, and the local cache's bandwidth, as
    settings.data_layout asks of each (the module's docstring, 5)."""
    nodes = settings.links.nodes(gpus)
    consumed_bytes = gpus / nodes * images * settings.image_bytes  # what one node's GPUs take in a step
    loader_ms = 1000.0 * images / settings.loader_images_per_second if settings.loader_images_per_second else 0.0

    def from_source(node_bytes: float, node_opens: float) -> float:
        limits = [loader_ms]
        if settings.storage_gbps:
            limits.append(1000.0 * nodes * node_bytes / gbps_to_bytes(settings.storage_gbps))
        if settings.node_storage_gbps:
            limits.append(1000.0 * node_bytes / gbps_to_bytes(settings.node_storage_gbps))
        if settings.node_opens_per_second:
            limits.append(1000.0 * node_opens / settings.node_opens_per_second)
        return max(limits)

    local_ms = max(loader_ms, 1000.0 * consumed_bytes / gbps_to_bytes(settings.cache_gbps) if settings.cache_gbps
                   else 0.0)
    if settings.data_layout == "warm-cache":
        return local_ms, local_ms
    if settings.data_layout == "shards+cache":  # a step's share of every node copying the whole dataset
        return from_source(gpus * images * settings.image_bytes, 0.0), local_ms
    opens = gpus / nodes * images if settings.data_layout == "files" else 0.0
    supply_ms = from_source(consumed_bytes, opens)
    return supply_ms, supply_ms


def without_data_limits(settings: Settings) -> Settings:
    """`settings` with no ceiling on the data supply (how the measured step is read)."""
    return replace(settings, loader_images_per_second=None, storage_gbps=None, node_storage_gbps=None,
                   node_opens_per_second=None, cache_gbps=None, data_layout="files")


def solve_compute_ms(settings: Settings, profile: ModelProfile, buckets: Sequence[Bucket]) -> float:
    """Forward+backward time per micro-batch such that the model reproduces the
    measured step at measured_gpus (the communication the model predicts there
    comes off the measured time). Bisection: the step grows with compute."""
    measured = replace(without_data_limits(settings), accumulation_steps=1)
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

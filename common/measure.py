"""Measurement: step timing, memory and block-device I/O, apart from where
the figures go (common.telemetry).

Timing costs no device synchronisation per step: the host reads the clock
when a batch arrives and when a step is queued; the device is synchronised
only where a measurement needs it (the end of the warm-up steps, and the
print intervals and epoch ends, which read the metrics anyway). So
`data wait` is the time the host waited for the input pipeline: when the
device is the bottleneck the host runs ahead and waits at those syncs
instead, and the share is small; when the pipeline is, it is large.

The figures that span processes are explicit collectives here
(StepTimer.finish, gather_io_rows), called by the loop on every process.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

import torch

from common.config import OBJECT_STORE_SCHEMES, Config, is_sharded
from common.distributed import Context, all_reduce_max, all_reduce_sum, gather_to_primary
from common.files import MIB, filesystem_type
from common.meters import SplitTiming

# Two kinds of rows: "device", a block device's rates sampled every --io-interval (IOSampler); "data", a node's
# bytes of one split of one epoch, pulled from DATA's storage and read from its node-local cache (data_rows).
IO_COLUMNS = ["wall_time", "host", "device", "read_bytes_per_second", "write_bytes_per_second",
              "read_ops_per_second", "write_ops_per_second", "kind", "epoch", "split", "source_bytes", "cache_bytes"]
T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(devices: List[torch.device]) -> float:
    """On GPUs, the peak memory held by tensors since the last reset (the
    split's start: see StepTimer), the most on any of `devices`; on the CPU,
    the peak resident memory of this process since it started (data-loading
    workers not included)."""
    if devices[0].type == "cuda":
        return max(torch.cuda.max_memory_allocated(device) for device in devices) / MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def host_memory_mib() -> float:
    """This process's resident memory now (data-loading workers not
    included), from /proc; NaN where there is none. Unlike the peak it can
    fall, so a leak shows as growth from epoch to epoch."""
    try:
        with open("/proc/self/statm") as handle:
            resident_pages = int(handle.read().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB


def private_bytes() -> int:
    """This process's private memory (pages no other process shares), from
    Linux's /proc/self/smaps_rollup."""
    with open("/proc/self/smaps_rollup") as handle:
        return sum(int(line.split()[1]) * 1024 for line in handle if line.startswith("Private_"))


def bytes_a_forked_reader_copies(samples) -> int:
    """How much memory a process forked now makes its own by reading every
    sample of `samples` once, as a data-loading worker does in an epoch
    (Linux): pages it shared with this process until a read wrote to them
    (Python's reference counts). Measured in a child that exits at once."""
    gc.collect()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as a forked data-loading worker
        try:
            os.close(reader)
            before = private_bytes()
            for index in range(len(samples)):
                path, target = samples[index]  # as ImageFolderDataset reads a sample: the pair and its parts
            os.write(writer, str(private_bytes() - before).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as handle:
        said = handle.read()
    os.waitpid(pid, 0)
    return int(said)


class StepTimer:
    """Wall time of one split's steps on this process. The first
    `warmup_steps` are left out of the rates (start-up, cuDNN autotuning,
    workers filling their queues), unless the split has at most twice as
    many steps, when every step counts. Call batch_ready() when a batch
    arrives and step_done() when its step is queued. `clock`: seconds, for tests."""

    def __init__(self, steps: int, warmup_steps: int, devices: List[torch.device], clock=time.perf_counter):
        # `steps`: the primary's count, the same on every process (validation shards can differ by a
        # batch), so all of them leave out the same warm-up and their timed images add up.
        self.warmup_steps = warmup_steps if steps > 2 * warmup_steps else 0
        self.device = devices[0]
        self.devices = devices
        if self.device.type == "cuda":
            for device in devices:
                torch.cuda.reset_peak_memory_stats(device)
        self.clock = clock
        self.completed = 0
        self.data_wait_seconds = 0.0  # after the warm-up
        self.all_data_wait_seconds = 0.0  # every step, for the print intervals
        self.start = self.timed_start = self.step_end = clock()

    @property
    def timing(self) -> bool:
        """Whether the current step counts for the rates (it is past the warm-up)."""
        return self.completed >= self.warmup_steps

    def mean_step_seconds(self) -> Optional[float]:
        """The mean wall time of the steps completed after the warm-up, what
        each step still to come is expected to take; None before one is."""
        timed_steps = self.completed - self.warmup_steps
        return (self.step_end - self.timed_start) / timed_steps if timed_steps > 0 else None

    def batch_ready(self) -> None:
        wait = self.clock() - self.step_end
        self.all_data_wait_seconds += wait
        if self.timing:
            self.data_wait_seconds += wait

    def waiting(self, fetch: Callable[[], T]) -> T:
        """fetch()'s result, its time counted as data wait: a step's later
        micro-batches (--accum-steps) wait for data inside the step."""
        started = self.clock()
        fetched = fetch()
        wait = self.clock() - started
        self.all_data_wait_seconds += wait
        if self.timing:
            self.data_wait_seconds += wait
        return fetched

    def step_done(self) -> None:
        self.completed += 1
        if self.completed == self.warmup_steps:
            synchronize(self.device)  # the warm-up's queued work is not billed to the timed steps
            self.timed_start = self.clock()
        self.step_end = self.clock()

    @contextlib.contextmanager
    def paused(self):
        """Leave what happens meanwhile (writing a checkpoint) out of every figure."""
        paused_at = self.clock()
        try:
            yield
        finally:
            pause = self.clock() - paused_at
            self.start += pause
            self.timed_start += pause
            self.step_end += pause

    def finish(self, ctx: Context, before: Optional[SplitTiming] = None) -> SplitTiming:
        """The split's timing; call after the epoch's metrics are reduced (which
        waits for the device and the slowest process). A collective: the peak
        memory is the maximum over processes, the data-wait share is over all
        of them (their waits summed over their timed wall times). `before`:
        the same split's timing up to a mid-epoch checkpoint this run resumed
        from, which the result includes (each part left out its own warm-up)."""
        now = self.clock()
        timed_seconds = now - self.timed_start if self.timing else 0.0  # nothing is timed before the warm-up ends
        memory = torch.tensor([peak_memory_mib(self.devices), host_memory_mib()], dtype=torch.float64,
                              device=ctx.device)
        peak, host_memory = all_reduce_max(memory, ctx).tolist()
        # The data-wait share of all processes together: one slow input pipeline shows, not just the primary's.
        waits = torch.tensor([self.data_wait_seconds, timed_seconds], dtype=torch.float64, device=ctx.device)
        wait_seconds, all_timed_seconds = all_reduce_sum(waits, ctx).tolist()
        # A part that ends within its warm-up (a mid-epoch checkpoint) left out only the steps it ran.
        timing = SplitTiming(steps=self.completed, warmup_steps=min(self.warmup_steps, self.completed),
                             seconds=now - self.start,
                             timed_seconds=timed_seconds, data_wait_seconds=wait_seconds,
                             all_timed_seconds=all_timed_seconds, peak_memory_mib=peak,
                             host_memory_mib=host_memory)
        return timing.plus(before) if before is not None else timing


class StepProfiler:
    """--profile-steps N: torch.profiler over N training steps, after the
    throughput warm-up of the first epoch this run trains, on the primary
    process only (one profile is what a reader opens; the others run as
    usual). It writes into `folder`: trace.json, a Chrome trace
    (chrome://tracing, or ui.perfetto.dev), and summary.txt: the wall time
    per step, on a GPU the share of it in which no kernel or copy ran
    (launch overhead, host syncs, waits for data), the operators and
    kernels by their own time on the device (CPU time on the CPU), and the
    loop's labelled parts (`step:...`, engine) by their CPU time: the host's
    own work per step. Call step() after each training step (outside the
    timed work: writing the profile takes a while), close() at the epoch's end."""

    LABELS = ("ProfilerStep", "step:")  # the profiler's and engine's ranges: not operators, not kernels
    KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's GPU work

    def __init__(self, steps: int, first_step: int, device: torch.device, folder):
        """Record steps first_step .. first_step + steps - 1 of the epoch
        (counted from 0 at start; first_step >= 1: the step before it is the
        profiler's own warm-up, recorded and dropped)."""
        from torch import profiler

        # Kineto, the profiler's tracer, logs an ERROR line when a CUDA build of torch finds no GPU, harmless
        # here: level 5 keeps it quiet (read when the profiler starts; a user's own setting wins).
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.folder = folder
        self.steps = steps
        self.first_step = first_step
        self.on_gpu = device.type == "cuda"
        activities = [profiler.ProfilerActivity.CPU] + ([profiler.ProfilerActivity.CUDA] if self.on_gpu else [])
        schedule = profiler.schedule(wait=first_step - 1, warmup=1, active=steps, repeat=1)
        self.profile = profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write)
        self.calls = 0  # steps done since start()
        self.summary: Optional[str] = None  # the line to print, once the profile is written
        self.profile.start()

    @staticmethod
    def in_run(run_dir, epoch: int, first_step: int, steps: int, skip_steps: int,
               device: torch.device) -> "StepProfiler":
        """A profiler of epoch `epoch`, whose first step in this run is
        `first_step`, skipping `skip_steps` (at least 1) of them: it writes
        into run_dir/profile-epoch<E>-step<S>/ (S: the first profiled step);
        a resume that profiles the same step again writes beside it."""
        skip = max(1, skip_steps)
        folder = run_dir / f"profile-epoch{epoch:03d}-step{first_step + skip:06d}"
        copies = 1
        while folder.exists():
            copies += 1
            folder = folder.with_name(f"{folder.name.split('.')[0]}.{copies}")
        return StepProfiler(steps, skip, device, folder)

    def step(self) -> None:
        if self.summary is None:
            self.calls += 1
            self.profile.step()

    def close(self) -> str:
        """Stop profiling (at the epoch's end, or a stop); the line to print:
        what the profile found and where it is, or that the epoch ended too soon."""
        if self.profile is not None:
            self.profile.stop()
            self.profile = None
        return self.summary or (f"profile: the epoch ended before --profile-steps {self.steps} steps after the "
                                f"warm-up; nothing recorded")

    def _write(self, done) -> None:
        try:
            self._write_files(done)
        except OSError as error:  # a full disk: the profile is lost, not the run
            self.summary = f"profile: not written to {self.folder} ({error.strerror or error})"
        except Exception as error:  # the profiler's own failure (a torch version's): nor does it end the run
            self.summary = f"profile: not written to {self.folder} ({type(error).__name__}: {error})"

    def _write_files(self, done) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace_path = self.folder / "trace.json"
        done.export_chrome_trace(str(trace_path))
        # The trace's categories tell host ranges from GPU work in every torch 2.x (events() mixes in the
        # GPU-side copies of the ranges). Whole training steps only: an epoch that ends early leaves a
        # part-step (the epoch's end) recorded.
        events = json.loads(trace_path.read_text())["traceEvents"]
        whole = max(0, min(self.steps, self.calls - self.first_step))
        steps = sorted(((float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))) for event in events
                        if event.get("cat") == "user_annotation" and
                        str(event.get("name", "")).startswith("ProfilerStep")))[:whole]
        if not steps:
            return
        start, end = steps[0][0], max(stop for _, stop in steps)
        counted = f"{len(steps)} step(s)" if len(steps) >= self.steps else \
            f"{len(steps)} of {self.steps} steps (the epoch ended sooner)"
        line = f"{counted} profiled: {(end - start) / 1000 / len(steps):.1f} ms per step"
        if self.on_gpu:
            work = [(max(start, float(event["ts"])), min(end, float(event["ts"]) + float(event.get("dur", 0))))
                    for event in events if event.get("cat") in self.KERNEL_CATEGORIES]
            idle = 1.0 - busy_microseconds([(a, b) for a, b in work if b > a]) / (end - start)
            line += f"; the GPU ran no kernel or copy {100 * idle:.1f}% of that time"
        from torch.autograd.profiler_util import EventList

        averages = done.key_averages()
        operators = EventList([row for row in averages if not row.key.startswith(self.LABELS)])
        parts = [row for row in averages if row.key.startswith("step:")]
        sort_by = "self_cuda_time_total" if self.on_gpu else "self_cpu_time_total"
        (self.folder / "summary.txt").write_text(
            f"{line}\n\nOperators and kernels, by their own time on the {'GPU' if self.on_gpu else 'CPU'}:\n"
            f"{operators.table(sort_by=sort_by, row_limit=40, max_name_column_width=80)}\n\n"
            f"The loop's parts (common/engine.py), by CPU time:\n"
            f"{parts_table(parts, len(steps), (end - start) / len(steps))}\n")
        self.summary = f"profile: {line}; {self.folder / 'summary.txt'}, {trace_path}"


def parts_table(parts, steps: int, step_microseconds: float) -> str:
    """The loop's labelled ranges (key, count, cpu_time_total in µs: the
    profiler's averages) as a table of host time per step. Not torch's
    EventList.table: on a GPU the ranges also carry device time and no
    self device time, and its share column then fails an assertion."""
    lines = [f"{'part':<32}{'CPU ms/step':>13}{'of the step':>13}{'calls':>8}"]
    for row in sorted(parts, key=lambda row: -row.cpu_time_total):
        per_step = row.cpu_time_total / steps
        lines.append(f"{row.key:<32}{per_step / 1000:>13.3f}{100 * per_step / step_microseconds:>12.1f}%"
                     f"{row.count:>8}")
    return "\n".join(lines)


def busy_microseconds(intervals: List[Tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time in which
    at least one of them ran (kernels on several streams overlap)."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


class DiskCounters(NamedTuple):
    """Cumulative counters of one block device, from /proc/diskstats."""

    major: int
    minor: int
    reads: int  # completed read operations
    read_bytes: int
    writes: int
    write_bytes: int


def read_diskstats(path: str = "/proc/diskstats") -> Dict[str, DiskCounters]:
    """Block devices by name; diskstats counts in 512-byte sectors, whatever
    the device's own sector size."""
    devices = {}
    with open(path) as handle:
        for line in handle:
            fields = line.split()
            if len(fields) >= 10:
                major, minor, name = int(fields[0]), int(fields[1]), fields[2]
                devices[name] = DiskCounters(major, minor, int(fields[3]), 512 * int(fields[5]), int(fields[7]),
                                             512 * int(fields[9]))
    return devices


def block_device_of(path: str, diskstats: str = "/proc/diskstats") -> Tuple[Optional[str], str]:
    """The diskstats name of the block device holding `path`, or None and why
    there is none (a network or virtual file system: NFS, Lustre, GPFS,
    overlay, tmpfs, btrfs subvolumes)."""
    try:
        devices = read_diskstats(diskstats)
    except OSError as error:
        return None, f"no block-device counters on this system ({diskstats}: {error.strerror})"
    try:
        st_dev = os.stat(path).st_dev
    except OSError as error:  # say, a log directory that exists only on the primary's node
        return None, f"cannot see {path} on this node ({error.strerror})"
    for name, counters in devices.items():
        if (counters.major, counters.minor) == (os.major(st_dev), os.minor(st_dev)):
            return name, ""
    return None, f"no block-device counters for {path} (on a {filesystem_type(path)} file system)"


class IOSampler:
    """Samples the read and write rates of the block device holding the
    dataset every `interval_seconds`, in a background thread (run on one
    process per node). Where there are no counters, each sample says so
    with empty values: missing, not zero. Nothing here raises."""

    def __init__(self, dataset_path: str, interval_seconds: float, diskstats: str = "/proc/diskstats",
                 clock=time.time):
        self.interval_seconds = interval_seconds
        self.diskstats, self.clock = diskstats, clock
        self.host = socket.gethostname().split(".")[0]
        self.device, self.missing_reason = block_device_of(dataset_path, diskstats)
        self.rows: List[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="io-sampler", daemon=True)
        self._last = self._read()

    def _read(self) -> Tuple[float, Optional[DiskCounters]]:
        """Now and the device's counters (None where there are none). Never
        raises: the sampler must not stop training, nor leave other
        processes waiting in a collective for this one."""
        try:
            counters = read_diskstats(self.diskstats).get(self.device) if self.device else None
        except (OSError, ValueError):
            counters = None
        return self.clock(), counters

    def sample(self) -> None:
        """Record the rates since the previous sample."""
        (then, before), (now, after) = self._last, self._read()
        self._last = (now, after)
        row = {"wall_time": round(now, 3), "host": self.host, "device": self.device or f"none: {self.missing_reason}",
               "kind": "device"}
        if before is not None and after is not None and now > then:
            seconds = now - then
            row.update(read_bytes_per_second=(after.read_bytes - before.read_bytes) / seconds,
                       write_bytes_per_second=(after.write_bytes - before.write_bytes) / seconds,
                       read_ops_per_second=(after.reads - before.reads) / seconds,
                       write_ops_per_second=(after.writes - before.writes) / seconds)
        with self._lock:
            self.rows.append(row)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.sample()

    def start(self) -> "IOSampler":
        self._thread.start()
        return self

    def take_rows(self) -> List[dict]:
        with self._lock:
            rows, self.rows = self.rows, []
        return rows

    def stop(self) -> None:
        """Stop sampling; the time since the last sample becomes a last row if it is a second or more."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.clock() - self._last[0] >= 1.0:
            self.sample()


def start_io_sampler(cfg: Config, ctx: Context) -> Optional[IOSampler]:
    """--io-interval: one process per node samples (local rank 0) the
    dataset's device (for shards, their folder's, or the node-local cache's
    with --data-cache), or for --synthetic runs the log directory's; None on
    the others, when sampling is off, and for shards read straight from an
    object store (no device of this node holds them)."""
    if cfg.io_interval <= 0 or ctx.local_rank != 0:
        return None
    if cfg.synthetic:
        path = cfg.logdir
    elif cfg.data_cache:
        path = cfg.data_cache  # shards: where every read goes once a shard's first read has copied it
    elif is_sharded(cfg.data):
        if cfg.data.startswith(OBJECT_STORE_SCHEMES):
            print(f"note: I/O sampling: DATA {cfg.data} is an object store, no block device of this node; io.csv's "
                  f"data rows say what each node pulled from it per epoch", flush=True)
            return None
        path = cfg.data
    else:
        path = os.path.join(cfg.data, "train")  # where almost all reads go (it may link to another disk than DATA's)
    sampler = IOSampler(path, cfg.io_interval).start()
    if sampler.device is None:
        print(f"note: I/O sampling on {sampler.host}: {sampler.missing_reason}; io.csv marks its samples missing "
              f"(the bytes the input pipeline read are in metrics.csv, dataset_bytes)", flush=True)
    return sampler


def gather_io_rows(sampler: Optional[IOSampler], ctx: Context, final: bool = False, epoch: Optional[int] = None,
                   read_bytes: Optional[Dict[str, Tuple[int, int]]] = None) -> List[dict]:
    """Every node's I/O samples since the last call, on the primary (empty
    elsewhere), then with `read_bytes` (this process's {split: (bytes from
    the source, bytes from the cache)} of `epoch`) one "data" row per node
    and split. A collective: every process calls it. `final`: stop
    sampling first (the run's end)."""
    if sampler is not None and final:
        sampler.stop()
    rows = sampler.take_rows() if sampler is not None else []
    gathered = gather_to_primary((rows, socket.gethostname().split(".")[0], dict(read_bytes or {})), ctx)
    return [row for rank_rows, _, _ in gathered for row in rank_rows] + data_rows(
        epoch, [(host, reads) for _, host, reads in gathered])


def data_rows(epoch: Optional[int], reads: List[Tuple[str, Dict[str, Tuple[int, int]]]]) -> List[dict]:
    """io.csv's "data" rows: each process's (host, {split: (source bytes,
    cache bytes)}) summed per node and split, in the order met."""
    per_node: Dict[Tuple[str, str], List[int]] = {}
    for host, splits in reads:
        for split, (source_bytes, cache_bytes) in splits.items():
            total = per_node.setdefault((host, split), [0, 0])
            total[0] += source_bytes
            total[1] += cache_bytes
    return [{"kind": "data", "host": host, "device": "", "epoch": epoch, "split": split, "source_bytes": source_bytes,
             "cache_bytes": cache_bytes} for (host, split), (source_bytes, cache_bytes) in per_node.items()]

"""The benchmark's sections: what each measures, as the configurations it
plans and the rows it makes of them.

  train, input, end-to-end   configurations measured in fresh processes,
                             round-robin (repeats.measure_section)
  data-scale                 data_scale's rows, with the machine
  comm                       all-reduce sizes among N processes, one row a size
  scaling                    a DDP step at 1 and N processes per hook, split
                             into compute, exposed communication and data wait
  decode                     DALI's decoders alone, per hw_decoder_load: one
                             process per repeat measures them all
"""
from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence

from common.arguments import usable_cores
from common.errors import error_summary
from common.tools.bench import data_scale
from common.tools.bench.gpu_monitor import GpuMonitor
from common.tools.bench.machine import half_support, with_machine
from common.tools.bench.measurements import SCALING_POWERSGD_START_STEP, warm_page_cache
from common.tools.bench.processes import ChildFailed, run_child, run_script
from common.tools.bench.repeats import Planned, finish, measure_section
from common.tools.bench.report import emit, record, rounded, size_name
from common.tools.bench.settings import Settings
from common.tools.bench.targets import END_TO_END_CONFIG
from common.tools.scaling import HOOKS, bus_bandwidth

# (config name, script, extra flags): the entry scripts' configurations of the train section.
# imagenet_ddp*.py run as one process here; on a GPU imagenet_dp.py is DataParallel over one GPU.
TRAIN_CONFIGS = (
    ("nd", "imagenet_nd.py", []),
    ("nd contiguous", "imagenet_nd.py", ["--memory-format", "contiguous"]),
    ("dp", "imagenet_dp.py", []),
    ("ddp", "imagenet_ddp.py", ["--nproc-per-node", "1"]),
    ("ddp_apex O1", "imagenet_ddp_apex.py", ["--nproc-per-node", "1", "--opt-level", "O1"]),
    ("ddp_apex O2 channels_last", "imagenet_ddp_apex.py",
     ["--nproc-per-node", "1", "--opt-level", "O2", "--memory-format", "channels_last"]),
    ("ddp_apex auto", "imagenet_ddp_apex.py", ["--nproc-per-node", "1"]),  # the precision it picks on this machine
)
COMPILE_CONFIGS = (
    ("nd compile", "imagenet_nd.py", ["--compile"]),
    ("ddp_apex O2 channels_last compile", "imagenet_ddp_apex.py",
     ["--nproc-per-node", "1", "--opt-level", "O2", "--memory-format", "channels_last", "--compile"]),
)
INPUT_BACKENDS = ("reference", "pil", "torchvision", "gpu", "dali")  # dali: when --backends names it (a GPU's default)
END_TO_END_BACKENDS = ("torchvision", "gpu", "dali")  # what --data-backend each end-to-end row trains with
DALI_MISSING = "not installed: pip install -r requirements-dali.txt"


# --- train, input and end-to-end: configurations measured round-robin ---

def train_section(settings: Settings, logdir: Path, with_compile: bool, only: Optional[Sequence[str]] = None,
                  save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """The reference loop, then each script configuration: those named in
    `only` when given (compiled ones included), else all, the compiled ones
    `with_compile`."""
    common = dict(section="train", arch=settings.arch, batch_size=settings.batch_size,
                  image_size=settings.image_size, workers=settings.synthetic_workers, data_backend="synthetic")
    reference = {"kind": "reference-train", "arch": settings.arch, "batch_size": settings.batch_size,
                 "image_size": settings.image_size, "device": settings.device,
                 "warmup_steps": settings.warmup_steps, "steps": settings.steps}
    planned = [Planned("reference", dict(common, config="reference",
                                         command="common.tools.bench.measurements.reference_train_loop",
                                         workers=0,  # its batch is made on the device, once
                                         precision="fp32", memory_format="contiguous", compile=False,
                                         measured_steps=settings.steps, warmup_steps=settings.warmup_steps),
                       functools.partial(run_child, reference, settings.gpu))]
    for name, script, flags in TRAIN_CONFIGS + COMPILE_CONFIGS:
        if script == "imagenet_dp.py" and settings.device == "cpu":
            continue  # DataParallel without GPUs is the plain model: the nd row
        if not (name in only if only is not None else with_compile or "--compile" not in flags):
            continue
        fields = dict(common, config=name, compile="--compile" in flags)
        emulated = emulated_half(flags, settings.device)
        if emulated and not settings.measure_emulated:
            planned.append(Planned(name, dict(fields, precision=_asked_precision(flags, settings.device),
                                              note=f"{emulated}: skipped (--measure-emulated times it)"), None))
        else:
            planned.append(Planned(name, dict(fields, note=emulated),
                                   functools.partial(run_script, script, flags, settings, logdir)))
    return measure_section(planned, settings.repeats, settings, save)


def _asked_precision(flags: Sequence[str], device: str) -> str:
    """'O1 bf16' for the half-precision flags of a configuration; '' for fp32 and --opt-level auto."""
    level = flags[flags.index("--opt-level") + 1] if "--opt-level" in flags else None
    if level in (None, "O0"):
        return ""
    dtype = flags[flags.index("--amp-dtype") + 1] if "--amp-dtype" in flags else (
        "fp16" if device == "cuda" else "bf16")
    return f"{level} {dtype}"


def emulated_half(flags: Sequence[str], device: str) -> str:
    """'bf16 emulated on this CPU (AVX2)' where the configuration asks for a
    half type the device only emulates (common.hardware); '' otherwise."""
    asked = _asked_precision(flags, device)
    if not asked:
        return ""
    dtype = asked.split()[1]
    support = half_support(device)
    if support.native(dtype):
        return ""
    return f"{dtype} emulated on this {support.where} ({support.capability})"


def input_section(settings: Settings, root: str, save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """Every (backend, workers) configuration, settings.input_repeats times
    round-robin: a measurement of a second or two is easily slowed by what
    else the machine does, and alternating spreads any drift over all
    configurations alike."""
    warm_page_cache(root, (settings.input_batches + 1) * settings.batch_size, settings.batch_size)
    planned = []
    for backend in INPUT_BACKENDS:
        for workers in settings.workers:
            if backend == "gpu" and settings.device == "cpu":
                continue
            if backend == "dali" and ("dali" not in settings.backends or backend_missing(backend)):
                continue
            spec = {"kind": "input", "backend": backend, "root": root, "workers": workers,
                    "image_size": settings.image_size, "batch_size": settings.batch_size,
                    "batches": settings.input_batches, "device": settings.device}
            command = ("common.tools.bench.measurements.reference_input" if backend == "reference" else
                       f"--data-backend {backend} -j {workers}")
            planned.append(Planned(f"{backend} -j {workers}", dict(
                section="input", config=backend, command=command, data_backend=backend, workers=workers,
                batch_size=settings.batch_size, image_size=settings.image_size, measured_steps=settings.input_batches,
                warmup_steps=1), functools.partial(run_child, spec, settings.gpu)))
    return measure_section(planned, settings.input_repeats, settings, save)


def end_to_end_section(settings: Settings, logdir: Path, root: str,
                       save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """The fastest configuration of the train section (fp32 imagenet_nd.py on
    the CPU, AMP + channels-last on a GPU) training on the JPEGs of `root`
    with each data backend of settings.backends, and on synthetic data, all in
    the same rounds: real over synthetic says how input-bound each backend
    leaves training. -j: Settings.data_workers and synthetic_workers (on a
    GPU both the scripts' default). A backend that cannot run here gets a row saying why."""
    workers = settings.data_workers
    name = END_TO_END_CONFIG[settings.device == "cuda"]
    _, script, flags = next(config for config in TRAIN_CONFIGS if config[0] == name)
    # The first W + N batches of the epoch the scripts draw (seed 0): the files they will read, once each.
    warm_page_cache(root, (settings.warmup_steps + settings.steps) * settings.batch_size, settings.batch_size)
    common = dict(section="end-to-end", config=name, arch=settings.arch, batch_size=settings.batch_size,
                  image_size=settings.image_size, compile=False)
    planned = [Planned("synthetic", dict(common, data_backend="synthetic", workers=settings.synthetic_workers),
                       functools.partial(run_script, script, flags, settings, logdir))]
    for backend in settings.backends:
        missing = backend_missing(backend)
        planned.append(Planned(f"--data-backend {backend}", dict(common, data_backend=backend, workers=workers,
                                                                  note=missing),
                               None if missing else functools.partial(
                                   run_script, script, [*flags, "--data-backend", backend], settings, logdir,
                                   data=root, workers=workers)))
    return measure_section(planned, settings.repeats, settings, save)


# The decode section: DALI's decoders alone (measurements.measure_decode), whole files and the training's crops,
# at each share of a batch the GPU's hardware JPEG decoder takes: none (nvJPEG's CUDA decoder only), DALI's
# default, most. On the CPU DALI's CPU decoder, once per pipeline: a baseline, labelled so.
DECODE_PIPELINES = ("whole", "crops")
DECODE_LOADS = (0.0, 0.65, 0.9)
DECODE_CPU_NOTE = "DALI's CPU decoder (libjpeg-turbo): a baseline; hw_decoder_load needs a GPU"


def decode_section(settings: Settings, root: str, save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """DALI's decode alone, in images/s: a fresh process per repeat
    (settings.input_repeats) measures every configuration in turn, one row
    each with the median over the repeats. DALI's threads: the scripts'
    (Settings.data_workers, which --data-backend dali gives DALI)."""
    on_gpu = settings.device == "cuda"
    configs = [(name, load) for name in DECODE_PIPELINES for load in (DECODE_LOADS if on_gpu else (None,))]
    spec = {"kind": "decode", "root": root, "device": settings.device, "batch_size": settings.batch_size,
            "image_size": settings.image_size, "threads": settings.data_workers, "warmup": 3 if on_gpu else 1,
            "batches": settings.input_batches, "configs": configs}
    fields = [dict(section="decode", config=_decode_config(name, load), data_backend="dali",
                   batch_size=settings.batch_size, image_size=settings.image_size, workers=spec["threads"],
                   command=f"common.tools.bench.measurements.measure_decode: "
                           f"{'fn.decoders.image' if name == 'whole' else 'common.dali.build_pipeline'}, device "
                           f"{'mixed' if on_gpu else 'cpu'}" + (f", hw_decoder_load={load}" if on_gpu else ""),
                   measured_steps=spec["batches"], warmup_steps=spec["warmup"], note="" if on_gpu else DECODE_CPU_NOTE)
              for name, load in configs]
    measured = [[] for _ in configs]

    def measured_once(round_: int, found: dict) -> None:
        for index, figures in enumerate(found["configs"]):
            measured[index].append(figures)
            print(f"decode {fields[index]['config']}: {figures['images_per_second']:.1f} images/s ({found['images']} "
                  f"JPEGs a batch; repeat {round_} of {settings.input_repeats})", flush=True)
        if save is not None and round_ < settings.input_repeats:
            save([finish(row, done, None, settings) for row, done in zip(fields, measured)])

    failure = backend_missing("dali") or repeated_child("decode", spec, settings.input_repeats, settings.gpu,
                                                        measured_once)
    return [emit(finish(row, done, failure, settings)) for row, done in zip(fields, measured)]


def _decode_config(name: str, load: Optional[float]) -> str:
    what = "whole files" if name == "whole" else "training crops"
    return f"{what}, cpu decoder" if load is None else f"{what}, hw_decoder_load {load:g}"


def repeated_child(section: str, spec: dict, repeats: int, gpu: Optional[GpuMonitor],
                   measured_once: Callable[[int, dict], None]) -> Optional[str]:
    """`spec`'s measurement (one process measuring all of a section's
    configurations: comm, decode) in a fresh process per repeat, each
    result given to measured_once(round, result); the failure that ended
    the repeats ('failed in repeat N: ...'), None when none did."""
    for round_ in range(1, repeats + 1):
        try:
            measured = run_child(spec, gpu)
        except ChildFailed as error:
            print(f"{section}: {error}", flush=True)
            return f"failed in repeat {round_}: {error.reason}"
        measured_once(round_, measured)
    return None


def backend_missing(backend: str) -> str:
    """Why a data backend cannot run here ('' when it can): DALI is an optional package."""
    if backend != "dali":
        return ""
    from common import dali

    error = dali.import_failure()
    if error is None:
        return ""
    return DALI_MISSING if dali.not_installed(error) else f"nvidia.dali cannot be imported: {error_summary(error)}"


def data_scale_section(cache: Path, classes: int, per_class: int, code: Mapping) -> List[dict]:
    """The data-scale section's rows (data_scale), with the machine and the code (Settings.code)."""
    rows = []
    for measured in data_scale.data_scale_rows(cache, classes, per_class):
        rows.append(rounded(with_machine(record(**measured), code)))
    return rows


# --- comm and scaling: among N processes this harness starts ---

def comm_rows(measurements: Sequence[dict], failure: Optional[str], world_size: int, backend: str,
              sizes: Sequence[int], code: Mapping) -> List[dict]:
    """One row per all-reduce size from the repeats' measurements ({"sizes":
    [{size_bytes, time_us}, ...]} each): the median time, algbw = bytes / time,
    busbw = algbw x 2(n-1)/n, the spread of the times; the failure, if any, in
    every row's note (rows without figures when nothing was measured); `code`:
    Settings.code."""
    rows = []
    for size in sizes:
        times = [found["time_us"] for measured in measurements for found in measured["sizes"]
                 if found["size_bytes"] == size]
        fields = dict(section="comm", config=f"all_reduce {size_name(size)}", world_size=world_size, backend=backend,
                      command=f"torch.distributed.all_reduce, float32, {world_size} processes "
                              f"(common.tools.bench.comm_bench)",
                      size_bytes=size, note=failure or "")
        if times:
            median = statistics.median(times)
            algbw = size / (median * 1e-6)
            fields.update(time_us=median, repeats=len(times), algbw_gbytes_per_s=algbw / 1e9,
                          busbw_gbytes_per_s=bus_bandwidth(algbw, world_size) / 1e9,
                          spread_percent=100.0 * (max(times) - min(times)) / median if len(times) > 1 else "")
        rows.append(rounded(with_machine(record(**fields), code)))
    return rows


def comm_section(settings: Settings, save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """All-reduce of each size of settings.comm_sizes among settings.comm_world_size
    processes on this machine, the backend the device uses (gloo on the CPU,
    nccl on GPUs), settings.repeats times, each a fresh set of processes."""
    world, backend = settings.comm_world_size, ("nccl" if settings.device == "cuda" else "gloo")
    on_gpu = settings.device == "cuda"
    spec = {"kind": "comm", "world_size": world, "backend": backend, "sizes": list(settings.comm_sizes),
            "warmup": 5 if on_gpu else 2, "iterations": 50 if on_gpu else 20, "budget_seconds": 2.0 if on_gpu else 1.0,
            "threads": max(1, usable_cores() // world)}
    print(f"comm: all-reduce among {world} processes ({backend}), {len(spec['sizes'])} sizes from "
          f"{size_name(min(spec['sizes']))} to {size_name(max(spec['sizes']))}", flush=True)
    measurements = []

    def measured_once(round_: int, measured: dict) -> None:
        measurements.append(measured)
        for found in measured["sizes"]:
            algbw = found["size_bytes"] / (found["time_us"] * 1e-6)
            print(f"comm all_reduce {size_name(found['size_bytes'])}: {found['time_us']:.1f} us, algbw "
                  f"{algbw / 1e9:.3f} GB/s, busbw {bus_bandwidth(algbw, world) / 1e9:.3f} GB/s (repeat {round_} of "
                  f"{settings.repeats}, process {measured.get('process', '?')})", flush=True)
        if save is not None and round_ < settings.repeats:
            save(comm_rows(measurements, None, world, backend, spec["sizes"], settings.code))

    failure = repeated_child("comm", spec, settings.repeats, settings.gpu, measured_once)
    return [emit(row) for row in comm_rows(measurements, failure, world, backend, spec["sizes"], settings.code)]


# The scaling section's workload on the CPU: ResNet-18 at 64 px, 16 images per process (a third of a second a
# step on one core: its 5 configurations take about a minute); on a GPU the train section's model and batch.
SCALING_CPU = {"batch_size": 16, "image_size": 64, "warmup": 2, "steps": 4}
SCALING_GPU_STEPS = {"warmup": 10, "steps": 20}
SCALING_HOOKS = HOOKS  # every --ddp-comm-hook (the scaling model's list)


def split_step(sync_ms: float, no_sync_ms: float, data_wait_ms: float = 0.0) -> dict:
    """A DDP step split three ways: exposed communication = the step with
    gradient synchronisation less the same step without it (no_sync()); data
    wait = the time the step waited for input (0 with tensors already on the
    device); compute = the rest of the step without synchronisation."""
    return {"ms_per_step": sync_ms, "compute_ms": no_sync_ms - data_wait_ms, "exposed_comm_ms": sync_ms - no_sync_ms,
            "data_wait_ms": data_wait_ms}


def _scaling_measure(spec: dict, gpu: Optional[GpuMonitor]) -> dict:
    measured = run_child(spec, gpu)
    split = split_step(measured["sync_ms"], measured["no_sync_ms"])
    return dict(measured, **split, images_per_second=spec["world_size"] * spec["batch_size"] * 1000.0 / split[
        "ms_per_step"])


def scaling_section(settings: Settings, save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """A DDP training step at 1 process and at settings.comm_world_size, with
    each communication hook at the latter (a hook at 1 process is refused):
    its time split into compute, exposed communication and data wait
    (split_step). Synthetic tensors on the device: no data wait, by construction."""
    on_gpu = settings.device == "cuda"
    workload = dict(arch=settings.arch, batch_size=settings.batch_size, image_size=settings.image_size,
                    **SCALING_GPU_STEPS) if on_gpu else dict(arch=settings.arch, **SCALING_CPU)
    backend = "nccl" if on_gpu else "gloo"
    planned = []
    for world, hook in [(1, "none")] + [(settings.comm_world_size, hook) for hook in SCALING_HOOKS]:
        spec = dict(workload, kind="scaling", world_size=world, backend=backend, hook=hook,
                    threads=max(1, usable_cores() // world) if not on_gpu else 1)
        fields = dict(section="scaling", config=f"{world} process{'es' if world > 1 else ''}, hook {hook}",
                      world_size=world, backend=backend, hook=hook, arch=workload["arch"],
                      batch_size=workload["batch_size"], image_size=workload["image_size"], data_backend="synthetic",
                      workers=0, measured_steps=workload["steps"], warmup_steps=workload["warmup"],
                      command="common.tools.bench.comm_bench.ddp_step_times: common.comm.distributed_model"
                              + (f", --powersgd-start-step {SCALING_POWERSGD_START_STEP}" if hook == "powersgd" else ""),
                      note="data wait 0: synthetic tensors on the device")
        planned.append(Planned(f"{world} x hook {hook}", fields, functools.partial(_scaling_measure, spec, settings.gpu)))
    return measure_section(planned, settings.repeats, settings, save)

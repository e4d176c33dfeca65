"""The benchmark's command line (python -m common.tools.bench): its flags,
the defaults that depend on the device (the CPU's short harness, a GPU's
full one), the JPEG tree generated for the input and end-to-end sections,
the sections asked for run in turn with their rows written to the CSV as
they come, and the target lines at the end. Also the hidden --child flag
that each measured process is started with (processes.run_child).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import common.tools.bench
from common import provenance
from common.arguments import (Parser, check_batch_fits, check_fits_in_memory, data_workers_bytes, memory_bytes,
                              non_negative_int, positive_float, positive_int, usable_cores)
from common.errors import FAILED_EXIT_STATUS, UsageError
from common.tools.bench.gpu_monitor import GpuMonitor, gpus_to_sample
from common.tools.bench.machine import versions
from common.tools.bench.measurements import child
from common.tools.bench.report import write_csv
from common.tools.bench.sections import (COMPILE_CONFIGS, END_TO_END_BACKENDS, TRAIN_CONFIGS, comm_section,
                                         data_scale_section, decode_section, end_to_end_section, input_section,
                                         scaling_section, train_section)
from common.tools.bench.settings import Settings
from common.tools.bench.storage_section import storage_section
from common.tools.bench.targets import comm_lines, data_scale_lines, ratios, storage_lines

FAKE_CLASSES = 8
SECTIONS = ("train", "input", "end-to-end", "data-scale", "comm", "scaling", "storage", "decode")
CPU_LEAVES_OUT = ("decode",)  # by default: on the CPU only a baseline (DALI's CPU decoder), asked for by name


def parse_size(text: str) -> int:
    """'4KiB', '64MiB', '1GiB' or plain bytes -> bytes (--comm-sizes)."""
    match = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", text.strip())
    if not match or int(match.group(1)) < 4:
        raise argparse.ArgumentTypeError(f"expected a size like 4KiB, 64MiB or bytes (at least 4), got {text!r}")
    return int(match.group(1)) * {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[match.group(2)]


def comm_sizes_default(gpu: bool) -> Tuple[int, ...]:
    """4 KiB to 64 MiB by 16x on GPUs (nccl-tests' range, trimmed to DDP's buckets and the latency end);
    to 16 MiB on the CPU, where gloo's larger sizes take seconds."""
    return tuple(4096 << (4 * power) for power in range(5 if gpu else 4))


def fake_imagenet_per_class(settings: Settings) -> int:
    """Training images per class of the generated tree: more than one epoch
    of every measurement takes (the input section's warm-up batch and
    --input-batches; the end-to-end runs' W + N steps, which so read no file
    twice), with a batch to spare, the sampler dropping an epoch's incomplete
    last batch. On a GPU: 51 batches of 256, 13,056 files for 12,800 read."""
    batches = max(settings.input_batches + 2, settings.warmup_steps + settings.steps + 1)
    return max(64, -(-settings.batch_size * batches // FAKE_CLASSES))


def fake_imagenet(folder: Path, classes: int, per_class: int) -> str:
    """An ImageNet-shaped JPEG tree of `classes` x `per_class` in `folder` (common.tools.demo_data), made once."""
    from common.tools.demo_data import write_fake_imagenet

    root = folder / f"fake-imagenet-{classes}x{per_class}"
    write_fake_imagenet(root, classes=classes, train_per_class=per_class, val_per_class=2)
    return str(root)


# --- the flags ---

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.bench", description=common.tools.bench.__doc__.split("\n\n")[0],
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_section_flags(parser)
    _add_workload_flags(parser)
    _add_output_flags(parser)
    return parser


def _add_section_flags(parser: argparse.ArgumentParser) -> None:
    """--device, which sections run, and the comm and data-scale sections' own flags."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                        help="default: all on a GPU, all but decode on the CPU. decode: DALI's decoders alone, "
                             "images/s of whole files and of the training's crops at hw_decoder_load 0, 0.65 and "
                             "0.9 (on the CPU DALI's CPU decoder, a baseline labelled so); data-scale: an "
                             "ImageNet-sized file list's start-up time and memory (common/tools/bench/data_scale.py), on a tree of hard links built once into --data-cache; comm: "
                             "all-reduce bandwidth against message size among --comm-world-size processes; scaling: "
                             "a DDP step at 1 and --comm-world-size processes split into compute, exposed "
                             "communication and data wait, per communication hook (common/tools/bench/comm_bench.py); "
                             "storage: the read stage's images/s, MB/s and files opened per second from the folder "
                             "tree, its shards, the shards through an S3 server and through a warm node-local cache, "
                             "on local disk and on storage throttled to 1,000 read IOPS and 200 MB/s (as root; "
                             "common/tools/bench/storage_section.py)")
    parser.add_argument("--comm-world-size", type=positive_int, default=None, metavar="N",
                        help="processes of the comm and scaling sections (default: the GPUs of this machine on a "
                             "GPU, 2 on the CPU)")
    parser.add_argument("--comm-sizes", type=parse_size, nargs="+", default=None, metavar="SIZE",
                        help="all-reduce sizes of the comm section, like 4KiB 1MiB 64MiB (default: 4KiB to 64MiB by "
                             "16x on a GPU; to 16MiB on the CPU)")
    parser.add_argument("--data-scale", type=positive_int, nargs=2, default=[1000, 1281],
                        metavar=("CLASSES", "PER_CLASS"), help="the data-scale section's tree: ImageNet's shape by "
                                                               "default (1,281,000 training images)")


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """What is measured: the model and batch, the steps and repeats, the input's workers, data and backends,
    and which configurations of the train section."""
    parser.add_argument("-a", "--arch", default=None, help="default: resnet18 on the CPU, resnet50 on a GPU")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=None, help="default: 32 CPU, 256 GPU")
    parser.add_argument("--image-size", type=positive_int, default=224)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=None, help="default: 3 CPU, 10 GPU")
    parser.add_argument("--steps", type=positive_int, default=None, help="measured steps; default: 8 CPU, 40 GPU")
    parser.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                        help="measurements of each configuration, each in a fresh process, round-robin over the "
                             "section's configurations; a row reports their median and spread (default: 3 on a GPU; "
                             "on the CPU 3 in the input section and 1 in the train and end-to-end sections, which "
                             "keeps `make bench` near 7 minutes on 2 cores)")
    parser.add_argument("--workers", type=non_negative_int, nargs="+", default=None,
                        help="data-loading worker counts of the input section (default: 1 2 on the CPU, "
                             "4 8 12 on a GPU machine); on the CPU the end-to-end and storage sections use the "
                             "largest; on a GPU they and the synthetic rows use the scripts' default -j")
    parser.add_argument("--input-batches", type=positive_int, default=None, help="default: 10 CPU, 40 GPU")
    parser.add_argument("--input-rounds", type=positive_int, default=None, help=argparse.SUPPRESS)  # replaced
    parser.add_argument("--backends", nargs="+", choices=END_TO_END_BACKENDS, default=None,
                        help="--data-backend of each end-to-end row, dali also in the input section (default: "
                             "torchvision gpu dali on a GPU; torchvision on the CPU, where dali runs but slowly)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="a JPEG tree (DATA/train/<class>/...) for the input and end-to-end sections; default: "
                             "ImageNet-shaped JPEGs generated once into --data-cache")
    parser.add_argument("--data-cache", default=".bench-data", metavar="DIR")
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                        choices=[name for name, _, _ in TRAIN_CONFIGS + COMPILE_CONFIGS],
                        help="only these script configurations in the train section (the reference loop always "
                             "runs); default: all")
    parser.add_argument("--measure-emulated", action="store_true",
                        help="also time half-precision configurations whose half type this device emulates "
                             "(bf16 on CPUs without AVX512/AMX: about 16x slower than fp32); by default their rows "
                             "say so and are skipped")
    parser.add_argument("--compile", action="store_true", help="also time --compile configurations (the "
                                                                "compilation itself is in the warm-up steps)")


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """What each row records beside its figures (MFU's peak, the GPU sampled), the CSV, and the hidden
    flags of a measured process."""
    parser.add_argument("--peak-tflops", type=positive_float, default=None, metavar="TFLOPS",
                        help="the device's peak, for every training row's MFU (default: NVIDIA's dense figure for "
                             "the GPU's name and the row's precision, GPU_PEAK_TFLOPS; none on the CPU)")
    parser.add_argument("--gpu-index", default=None, metavar="ID",
                        help="the GPU (nvidia-smi -i: index or UUID) whose SM clock, power and temperature are "
                             "recorded beside each row (default: the GPU the runs use, with --device cuda; none on "
                             "the CPU)")
    parser.add_argument("--csv", default=None, metavar="PATH",
                        help="default: runs/bench/<date>_<time>_<host>_<cpu|gpu>.csv (a new file each run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)


# --- the run ---

def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(json.loads(args.child))))
        return
    if args.input_rounds is not None:
        raise UsageError("argument --input-rounds: replaced by --repeats N (every section: the median of N fresh "
                         "processes, where --input-rounds took the input section's best)")
    settings = settings_from(args)
    args.sections = sections_to_run(args.sections, settings.device)
    if args.data is not None and not Path(args.data, "train").is_dir():
        raise UsageError(f"argument --data: {args.data} has no train/ folder")
    stamp = time.strftime("%Y%m%d_%H%M%S")
    gpu = settings.device == "cuda"
    csv_path = Path(args.csv or f"runs/bench/{stamp}_{socket.gethostname()}_{'gpu' if gpu else 'cpu'}.csv")
    if csv_path.exists():
        raise UsageError(f"argument --csv: {csv_path} exists; choose another name (nothing is overwritten)")
    _print_plan(settings)
    rows = run_sections(args, settings, csv_path)
    print(f"\n{len(rows)} configurations written to {csv_path}", flush=True)
    for line in ratios(rows) + data_scale_lines(rows) + storage_lines(rows):
        print(line, flush=True)
    for line in comm_lines(rows):
        print(line, flush=True)
    failed = [row["config"] + (f" ({row['data_backend']})" if row["section"] == "end-to-end" else "")
              for row in rows if "failed in repeat" in str(row["note"])]
    if failed:
        print(f"{len(failed)} configuration(s) failed, their rows say how: {', '.join(failed)}", flush=True)
        sys.exit(FAILED_EXIT_STATUS)


def sections_to_run(asked: Optional[Sequence[str]], device: str) -> List[str]:
    """--sections, else every section on a GPU and all but CPU_LEAVES_OUT on the CPU, in SECTIONS' order."""
    return list(asked) if asked else [section for section in SECTIONS if device == "cuda" or section not in
                                      CPU_LEAVES_OUT]


def settings_from(args: argparse.Namespace) -> Settings:
    """The run's Settings from the flags: the device's defaults where a flag is
    not given; the comm and scaling sections' processes and sizes when they run."""
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("argument --device: cuda was asked for but no CUDA GPU is visible")
    gpu = device == "cuda"
    if not gpu and "gpu" in (args.backends or ()):
        raise UsageError("argument --backends: gpu decodes on a GPU; it needs --device cuda")
    settings = Settings(
        device=device, arch=args.arch or ("resnet50" if gpu else "resnet18"),
        batch_size=args.batch_size or (256 if gpu else 32), image_size=args.image_size,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else (10 if gpu else 3),
        steps=args.steps or (40 if gpu else 8), workers=args.workers or ([4, 8, 12] if gpu else [1, 2]),
        data=args.data, input_batches=args.input_batches or (40 if gpu else 10),
        repeats=args.repeats or (3 if gpu else 1), input_repeats=args.repeats or 3,
        backends=args.backends or (END_TO_END_BACKENDS if gpu else ("torchvision",)),
        measure_emulated=args.measure_emulated, peak_tflops=args.peak_tflops,
        gpu=_gpu_monitor(device, args.gpu_index), code=provenance.code_version())
    if {"comm", "scaling"} & set(args.sections or SECTIONS):
        settings = dataclasses.replace(settings, comm_world_size=_comm_world_size(args, gpu), comm_sizes=tuple(sorted(
            set(args.comm_sizes or (comm_sizes_default(gpu))))))
    _check_machine_fits(settings)
    return settings


def _check_machine_fits(settings: Settings) -> None:
    """What this machine could never hold, told before anything is measured
    (the training script's own limits, common.cli): a batch, the input
    section's data-loading processes, the comm section's messages."""
    memory = memory_bytes()
    check_batch_fits(settings.batch_size, settings.image_size, memory)
    workers = max(settings.workers)
    check_fits_in_memory("--workers", data_workers_bytes(workers, settings.batch_size, settings.image_size),
                         f"{workers} data-loading processes", memory)
    if settings.comm_world_size and settings.comm_sizes:
        largest = max(settings.comm_sizes)
        check_fits_in_memory("--comm-sizes", settings.comm_world_size * largest,
                             f"{settings.comm_world_size} processes' all-reduce of {largest:,} bytes", memory)


def _gpu_monitor(device: str, gpu_index: Optional[str]) -> Optional[GpuMonitor]:
    """The GpuMonitor of the GPU the runs use (or --gpu-index's); None on the CPU or where nvidia-smi does not answer."""
    candidates = gpus_to_sample(device, gpu_index)
    if not candidates:
        return None
    monitor = GpuMonitor(candidates)
    if monitor.gpu is None:
        print(f"GPU state: {monitor.problem}; SM clock, power and temperature are not recorded", flush=True)
        return None
    return monitor


def _comm_world_size(args: argparse.Namespace, gpu: bool) -> int:
    """The comm and scaling sections' processes: --comm-world-size, else this machine's GPUs (2 on the CPU)."""
    import torch

    world = args.comm_world_size or (torch.cuda.device_count() if gpu else 2)
    if world < 2:
        raise UsageError(f"argument --comm-world-size: {world} process{'' if world == 1 else 'es'}: communication "
                         f"needs at least 2" + (" (this machine has one GPU: give --comm-world-size 2 to put two "
                                                "processes on it)" if gpu and args.comm_world_size is None else ""))
    if gpu and world > torch.cuda.device_count():
        raise UsageError(f"argument --comm-world-size: {world} processes, one per GPU, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    if not gpu and world > usable_cores():
        raise UsageError(f"argument --comm-world-size: {world} processes on the CPU, but this machine gives the job "
                         f"{usable_cores()} core(s); at most one process per core")
    return world


def _print_plan(settings: Settings) -> None:
    """The line that opens a run: the machine, its half types, the workload and the repeats."""
    machine = versions()
    print(f"benchmark on {machine['device_name']} ({machine['capability']}: bf16 "
          f"{'native' if machine['bf16_native'] else 'emulated'}, fp16 "
          f"{'native' if machine['fp16_native'] else 'emulated'}): {settings.arch}, batch {settings.batch_size}, "
          f"{settings.warmup_steps} warm-up + {settings.steps} measured steps per configuration; "
          f"{_processes(settings.repeats)}" + (f" (input section: {_processes(settings.input_repeats)})"
                                                if settings.input_repeats != settings.repeats else "")
          + (f"; GPU state from nvidia-smi -i {settings.gpu.gpu}" if settings.gpu else ""), flush=True)


def _processes(repeats: int) -> str:
    return "one fresh process each" if repeats == 1 else f"the median of {repeats} fresh processes each"


def run_sections(args: argparse.Namespace, settings: Settings, csv_path: Path) -> List[dict]:
    """Every section asked for, in SECTIONS' order, their rows written to `csv_path` after each
    (and during one, after each round): what was measured survives a later failure or a time limit."""
    rows: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as logdir:
        root = None
        if {"input", "end-to-end", "storage", "decode"} & set(args.sections):
            root = args.data or fake_imagenet(Path(args.data_cache), FAKE_CLASSES, fake_imagenet_per_class(settings))

        def save(section_rows: List[dict]) -> None:
            write_csv(rows + section_rows, csv_path)

        sections = {"train": lambda: train_section(settings, Path(logdir), args.compile, args.configs, save),
                    "input": lambda: input_section(settings, root, save),
                    "end-to-end": lambda: end_to_end_section(settings, Path(logdir), root, save),
                    "data-scale": lambda: data_scale_section(Path(args.data_cache), *args.data_scale, settings.code),
                    "comm": lambda: comm_section(settings, save),
                    "scaling": lambda: scaling_section(settings, save),
                    "storage": lambda: storage_section(settings, Path(args.data_cache, "storage"), root, save),
                    "decode": lambda: decode_section(settings, root, save)}
        for section in SECTIONS:
            if section in args.sections:
                rows += sections[section]()
                write_csv(rows, csv_path)
    return rows

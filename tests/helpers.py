"""Plain helpers the test modules share: making data, running the entry scripts,
reading what a run wrote. Fixtures and pytest's hooks are in conftest.py; a
test module imports what it needs from here, never from another test module."""
from __future__ import annotations

import contextlib
import csv
import functools
import importlib.util
import io
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.ports import free_port  # noqa: F401 -- the one free-port helper, for the tests too
from common.rundir import CHECKPOINT_NAME

REPO = Path(__file__).resolve().parent.parent


# --- data ---

def make_image_folder(root: Path, classes: int = 3, train_per_class: int = 8, val_per_class: int = 3,
                      size: int = 24, seed: int = 0) -> Path:
    """A learnable tree root/{train,val}/class_<c>/<i>.JPEG: each class has
    its own mean colour, plus noise."""
    rng = np.random.default_rng(seed)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([(60 + 80 * label) % 256, (200 - 70 * label) % 256, (40 * label) % 256])
            for index in range(per_class):
                pixels = np.clip(colour + rng.normal(0, 25, size=(size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{index:03d}.JPEG", quality=90)
    return root


def encode_jpeg(mode: str, size=(37, 23), **options) -> bytes:
    """A JPEG file's bytes: random pixels of Pillow mode `mode`, saved with Pillow's `options`."""
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


@functools.cache
def jpeg_variants() -> dict:
    """{name: bytes} of the JPEG encodings real datasets hold. Made on first use, once per process:
    the large one takes a third of a second, which only the modules that use them should pay."""
    return {
        "baseline": encode_jpeg("RGB"), "grayscale": encode_jpeg("L"), "cmyk": encode_jpeg("CMYK"),
        "progressive": encode_jpeg("RGB", progressive=True), "optimized": encode_jpeg("RGB", optimize=True),
        "4:4:4": encode_jpeg("RGB", subsampling=0), "restart markers": encode_jpeg("RGB", restart_marker_blocks=1),
        "exif and icc": encode_jpeg("RGB", exif=b"Exif\x00\x00" + bytes(300), icc_profile=bytes(5000)),
        "large": encode_jpeg("RGB", size=(4000, 3000)),
    }


class RunsCode:
    """A pickle payload that would create the file `marker` when unpickled:
    what a malicious checkpoint or weights file holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


# --- running the entry scripts ---

# Environments the commands of the tests are forked in (tests/forked_python.py): the usual one, and
# the usual one with these variables set as run_command's env_extra sets them. A server serves one
# environment: a test that changes os.environ (monkeypatch; importing scikit-learn sets KMP_*
# variables) gets a server of its own, the least recently started of FORK_SERVERS_KEPT closed.
FORKED_VARIABLES = {"OMP_NUM_THREADS"}
FORK_SERVERS_KEPT = 3
_fork_servers: dict = {}


def run_command(argv, cwd: Path = REPO, timeout: float = 600, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root with no GPU visible (unless
    env_extra says otherwise); returns the finished process, text output.
    `python SCRIPT` and `python -m MODULE` in the usual environment are forked
    from a process that has imported torch already (tests/forked_python.py),
    2.5 to 6 s sooner by the CPU; IMAGENET_TESTS_FORK=0 starts every one afresh."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    argv = list(map(str, argv))
    server = _fork_server(env_extra or {}, env)
    if server is not None and server.serves(argv, env):
        return server.run(argv, cwd, env, timeout)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _fork_server(env_extra: dict, env: dict):
    if set(env_extra) - FORKED_VARIABLES or os.environ.get("IMAGENET_TESTS_FORK", "1") == "0":
        return None
    from forked_python import ForkServer, lasting

    key = tuple(sorted(lasting(env).items()))
    if key not in _fork_servers:
        while len(_fork_servers) >= FORK_SERVERS_KEPT:
            _fork_servers.pop(next(iter(_fork_servers))).close()
        _fork_servers[key] = ForkServer(env)
    return _fork_servers[key]


def close_fork_servers() -> None:
    """End run_command's fork servers (conftest's pytest_unconfigure, at the session's end)."""
    for server in _fork_servers.values():
        server.close()


def run_script(args, **kwargs) -> subprocess.CompletedProcess:
    """`python <args>` with this interpreter, as run_command."""
    return run_command([sys.executable, *args], **kwargs)


# Small and fast: 32-pixel crops, ResNet-18, one data worker (workers fixed, as resume tests need).
FAST_ARGS = ["-a", "resnet18", "--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "1", "-p", "1"]

# SqueezeNet 1.1 without dropout: small (1.2M parameters), BatchNorm-free and random-free in training,
# so one process with batch 2B and two processes with B each must compute the same steps.
# Full-image crops without flips: the augmentation is deterministic too.
MODEL = ["-a", "squeezenet1_1", "--dropout", "0", "--image-size", "32", "--val-resize", "32",
         "--crop-scale", "1", "1", "--hflip", "0", "-p", "1"]
# Identical numerics in every launcher's processes: one thread each (torchrun's default for several).
ENV = {"OMP_NUM_THREADS": "1"}


def start(argv, env_extra=None) -> subprocess.Popen:
    """Start a command from the repository root, no GPU visible, one thread (ENV); output in .stdout, stderr in it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **ENV, **(env_extra or {}))
    return subprocess.Popen(list(map(str, argv)), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(processes, timeout=300) -> list:
    """The outputs of processes from start(), each of which must exit with status 0."""
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
    return outputs


def assert_one_line_error(result, *fragments):
    """Exit status 2, one line on stderr (no traceback), holding every fragment."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- slowed training steps ---

# The sitecustomize.py of slowed runs: imported by every Python process started with slowed_steps()'s
# variables (PYTHONPATH), it wraps torch.optim.SGD.step when torch.optim.sgd is first imported, without
# importing torch itself: each step sleeps TEST_STEP_DELAY seconds first and, with TEST_STEP_LOG, writes
# the process's step count to a file of that folder named by its pid.
SLOW_STEPS = '''
import importlib.abc, importlib.machinery, os, sys, time

DELAY = float(os.environ.get("TEST_STEP_DELAY") or 0)
LOG_DIR = os.environ.get("TEST_STEP_LOG")


class SlowSGD(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.optim.sgd":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            step = module.SGD.step
            count = [0]

            def slow_step(self, *args, **kwargs):
                time.sleep(DELAY)
                result = step(self, *args, **kwargs)
                count[0] += 1
                if LOG_DIR:
                    with open(os.path.join(LOG_DIR, str(os.getpid())), "w") as handle:
                        handle.write(str(count[0]))
                return result

            module.SGD.step = slow_step

        spec.loader.exec_module = exec_module
        return spec


if DELAY > 0 or LOG_DIR:
    sys.meta_path.insert(0, SlowSGD())
'''


def write_slow_steps(folder: Path) -> Path:
    """`folder`, holding SLOW_STEPS as its sitecustomize.py: the PYTHONPATH entry slowed_steps() names."""
    (folder / "sitecustomize.py").write_text(SLOW_STEPS)
    return folder


def slowed_steps(folder: Path, delay_seconds: float, step_log: Path | None = None) -> dict:
    """The environment variables that make a command's training processes sleep `delay_seconds` in every
    optimizer step (and, with `step_log`, count their steps there): room, whatever the machine's speed,
    for a test to act between two steps. `folder`: from write_slow_steps. Sleeping changes no number."""
    variables = {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
                 "TEST_STEP_DELAY": str(delay_seconds)}
    if step_log is not None:
        step_log.mkdir(parents=True, exist_ok=True)
        variables["TEST_STEP_LOG"] = str(step_log)
    return variables


# --- what a run wrote ---

def single_run_dir(logdir: Path) -> Path:
    """The one run directory under `logdir`."""
    run_dirs = [path for path in logdir.iterdir() if path.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # only rank 0 writes
    return run_dirs[0]


def csv_rows(path: Path) -> list:
    """A CSV file's rows, as dicts of the strings written."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def metrics_rows(run_dir: Path) -> list:
    """metrics.csv's rows, every column, as written."""
    return csv_rows(run_dir / "metrics.csv")


# The columns of metrics.csv that two runs of the same steps must write alike (no timing, memory or bytes).
DETERMINISTIC_COLUMNS = ["epoch", "split", "loss", "top1", "top5", "images", "steps", "lr"]


def metrics(run_dir: Path) -> list:
    """metrics.csv's rows, only DETERMINISTIC_COLUMNS."""
    return [{column: row[column] for column in DETERMINISTIC_COLUMNS} for row in metrics_rows(run_dir)]


def is_timing_column(name: str) -> bool:
    """metrics.csv's columns that measure time, speed or memory, which differ from run to run:
    seconds, seconds_per_step, images_per_second(_per_gpu), data_wait_fraction,
    wall_time, peak_memory_mib, host_memory_mib. Everything else (loss, accuracy,
    counts, lr, dataset bytes, loss scale, ...) must repeat exactly."""
    return any(word in name for word in ("second", "time", "wait", "memory", "mib", "rss"))


def load_checkpoint(path: Path) -> dict:
    """A checkpoint file's whole state, on the CPU, tensors and plain types only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def weights(path: Path) -> dict:
    """The model's state_dict in a checkpoint file, or in a run directory's newest checkpoint."""
    path = Path(path)
    return load_checkpoint(path / CHECKPOINT_NAME if path.is_dir() else path)["state_dict"]


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest difference, element by element, between two state_dicts of the same tensors."""
    assert a.keys() == b.keys()
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a if a[key].numel())


def differing_tensors(a: dict, b: dict) -> list:
    """Names of the tensors that are not bit-identical (torch.equal: same shape, dtype and values)."""
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


# --- run directories with hand-computable numbers (common.tools.plots, common.tools.results) ---

UPSTREAM = REPO / "results" / "upstream"
START = 1_800_000_000.0  # UNIX seconds of the synthetic runs' first training step


def epoch_rows(epoch: int, train_start: float, images_per_second: float, val_top1: float,
               train_seconds: float = 100.0, val_seconds: float = 20.0, data_wait_fraction: float = 0.1) -> list:
    """metrics.csv rows (train, val) of one epoch, as common.telemetry writes them."""
    train = {"epoch": epoch, "split": "train", "loss": 2.0 - 0.1 * epoch, "top1": val_top1 - 5, "top5": 90.0,
             "images": int(images_per_second * train_seconds), "steps": 10, "seconds": train_seconds,
             "images_per_second": images_per_second, "seconds_per_step": train_seconds / 10,
             "data_wait_fraction": data_wait_fraction, "lr": 0.1, "wall_time": train_start + train_seconds,
             "loss_scale": "", "skipped_steps": "", "images_per_second_per_gpu": "", "warmup_steps": 2,
             "peak_memory_mib": "", "dataset_bytes": 1000, "macro_f1": ""}
    val = dict(train, split="val", loss=1.5, top1=val_top1, top5=95.0, images=50, steps=2, seconds=val_seconds,
               images_per_second=50 / val_seconds, lr="", wall_time=train_start + train_seconds + val_seconds,
               data_wait_fraction=0.0, macro_f1=val_top1 - 1)
    return [train, val]


def write_run(root: Path, name: str, replicas: int, rows: list, device: str = "cpu", desired_acc=None,
              columns: list | None = None, io_rows: list = None) -> Path:
    """A run directory: config.json, metrics.csv (only `columns`, default all of
    common.tools.plots.METRIC_COLUMNS), optional io.csv."""
    from common.tools import plots

    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"command": f"python imagenet_ddp.py --synthetic -a resnet18 --nproc-per-node {replicas}",
              "started": "2026-11-23T10:00:00+00:00", "start_epoch": 0,
              "options": {"arch": "resnet18", "batch_size": 4, "epochs": 3, "desired_acc": desired_acc,
                          "opt_level": "O0", "workers": 1, "data": None},
              "resolved": {"global_batch": 4 * replicas, "lr": 0.1, "precision": "fp32"},
              "environment": {"host": "node-a", "cpu_model": "Test CPU 9000", "python": "3.11.7",
                              "torch": "2.4.0", "torchvision": "0.19.0", "cuda": None, "device": device,
                              "world_size": replicas, "replicas": replicas, "launcher": "spawn"}}
    (run_dir / "config.json").write_text(json.dumps(config))
    with open(run_dir / "metrics.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=plots.METRIC_COLUMNS if columns is None else columns,
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    if io_rows is not None:
        with open(run_dir / "io.csv", "w", newline="") as handle:
            handle.write("wall_time,host,device,read_bytes_per_second,write_bytes_per_second,"
                         "read_ops_per_second,write_ops_per_second\n")
            handle.writelines(",".join(map(str, row)) + "\n" for row in io_rows)
    return run_dir


def make_runs(root: Path) -> dict:
    """Three CPU runs with hand-computable numbers (see each comment)."""
    from common.tools import plots

    # 2 processes, 3 epochs of 100 s training + 20 s validation; preempted after epoch 1 and resumed
    # 4,640 s later (the gap is no training time): 3 x 120 = 360 s. Throughput 40, 50, 60: mean 50.
    # An edited metrics.csv repeats epoch 1's train row: the last row (50 images/s) counts.
    rows = (epoch_rows(0, START, 40, 30.0) + [epoch_rows(1, START + 120, 999, 0)[0]]
            + epoch_rows(1, START + 120, 50, 55.0) + epoch_rows(2, START + 5000, 60, 60.0))
    # io.csv: two nodes every 10 s; reads 1 and 2 MB/s (total 3); write and op counters missing (empty).
    io_rows = [(START + t + offset, host, "sda", read, "", "", "")
               for t in (0, 10, 20) for host, offset, read in (("a", 0.0, 1e6), ("b", 0.4, 2e6))]
    two = write_run(root, "Nov23_10-00-00_node-a_resnet18_cpux2_b4_cpu1_optO0", 2, rows, desired_acc=50.0,
                    io_rows=io_rows)
    # Two 4-process runs in an older format (no columns after skipped_steps), 150 and 170 images/s:
    # grouped, their mean is 160 images/s, 40 per process; 2 epochs of 120 s each: 240 s.
    old_columns = plots.METRIC_COLUMNS[:plots.METRIC_COLUMNS.index("skipped_steps") + 1]
    four = [write_run(root, f"Nov24_1{i}-00-00_node-a_resnet18_cpux4_b4_cpu1_optO0", 4,
                      epoch_rows(0, START, speed, 20.0) + epoch_rows(1, START + 120, speed, 40.0),
                      columns=old_columns)
            for i, speed in enumerate((150, 170))]
    return {"two": two, "four": four}


# --- this machine ---

@contextlib.contextmanager
def memory_capped(extra_bytes: int = 2 << 30):
    """This process's address space capped at what it maps now plus
    `extra_bytes` for the `with` block: code that sizes memory by a value
    (a label of 10**15) fails with MemoryError there, instead of taking the
    machine's memory until the kernel kills someone. Restored after."""
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


def run_with_cached_architectures(code: str, cache_folder: Path) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter whose architecture names come from
    a cache made here first (XDG_CACHE_HOME=cache_folder), as every start after a
    torchvision (and timm) version's first does: so that what the code imports is the
    command line's own doing (the torch-free checks), not the names' listing."""
    from unittest import mock

    from common import architectures

    environment = dict(os.environ, XDG_CACHE_HOME=str(cache_folder))
    with mock.patch.dict(os.environ, environment):
        assert architectures.available_architectures.__wrapped__()
        architectures.timm_architectures.__wrapped__()  # timm's too, where installed (read for an unknown -a)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=120)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 natively (AVX512, AMX) as common.hardware sees
    it; on an AVX2-only CPU, or with ATEN_CPU_CAPABILITY=avx2 set, it is
    emulated: about 16x slower than fp32 (issue 25)."""
    from common import hardware

    return hardware.cpu_half_support().bf16_native


# NVIDIA DALI is optional (requirements-dali.txt; CI installs it): the tests of --data-backend dali
# that run it skip without it, with the reason shown.
def _dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no nvidia.* package at all
        return False


DALI_INSTALLED = _dali_installed()
needs_dali = pytest.mark.skipif(not DALI_INSTALLED,
                                reason="NVIDIA DALI is not installed (pip install -r requirements-dali.txt)")

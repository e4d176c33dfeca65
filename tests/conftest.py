"""Shared fixtures: tiny ImageFolder trees and a runner for the entry scripts."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.ports import free_port  # noqa: F401 -- the tests' free port (`from conftest import free_port`), common/'s

REPO = Path(__file__).resolve().parent.parent


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


class RunsCode:
    """A pickle payload that would create the file `marker` when unpickled:
    what a malicious checkpoint or weights file holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


@pytest.fixture
def tiny_data(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "data")


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


def pytest_unconfigure(config):
    for server in _fork_servers.values():
        server.close()


def run_script(args, **kwargs) -> subprocess.CompletedProcess:
    """`python <args>` with this interpreter, as run_command."""
    return run_command([sys.executable, *args], **kwargs)


# Small and fast: 32-pixel crops, ResNet-18, one data worker (workers fixed, as resume tests need).
FAST_ARGS = ["-a", "resnet18", "--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "1", "-p", "1"]


def is_timing_column(name: str) -> bool:
    """metrics.csv's columns that measure time, speed or memory, which differ from run to run:
    seconds, seconds_per_step, images_per_second(_per_gpu), data_wait_fraction,
    wall_time, peak_memory_mib, host_memory_mib. Everything else (loss, accuracy,
    counts, lr, dataset bytes, loss scale, ...) must repeat exactly."""
    return any(word in name for word in ("second", "time", "wait", "memory", "mib", "rss"))


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


# The markers, declared here rather than in pytest.ini so that they are known however pytest is
# started (`pytest -m slurm` from the repository root does not read tests/pytest.ini).
MARKERS = {
    "slow": "long end-to-end tests (minutes); `make test` runs them when CI=true",
    "gpu": "needs a CUDA GPU; skipped without one",
    "slurm": "submits the batch files to a real Slurm cluster started for the tests (root, slurm-wlm, munge)",
}


def pytest_configure(config):
    """The markers; and, started with SIGINT ignored (nohup, a background job of a script), pytest
    would pass that on to every launcher it starts, and the tests that interrupt one would wait for
    it forever."""
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped, with the reason shown, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True, scope="session")
def _file_list_cache_in_tmp(tmp_path_factory):
    """The runs' scans are cached in the user's cache folder (common.dataset_lists.cache_file): a
    temporary one for the tests and the scripts they start, not the tester's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))

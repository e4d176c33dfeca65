"""pytest's side of the tests: fixtures, markers and hooks. Plain helpers are in helpers.py."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from helpers import close_fork_servers, make_image_folder


@pytest.fixture
def tiny_data(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "data")


def pytest_unconfigure(config):
    close_fork_servers()


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


@pytest.fixture(autouse=True, scope="session")
def _file_list_cache_in_tmp(tmp_path_factory):
    """The runs' scans are cached in the user's cache folder (common.dataset_lists.cache_file): a
    temporary one for the tests and the scripts they start, not the tester's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))

"""pytest's side of the tests: fixtures, markers and hooks. Plain helpers are in helpers.py."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# Two test processes (make test) each start training processes of two CPU threads on CI's 2 cores: OpenMP's
# threads that spin while they wait for work (its default) then take turns with the other's, and two digits
# runs side by side measured 2.5x slower each than with waiting threads that sleep (2-core Xeon, torch 2.14).
# Set before torch is imported here or in any process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from helpers import close_fork_servers, make_image_folder  # noqa: E402 (after the variable: it imports torch)


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


# `make test` runs the tests in two processes (pytest-xdist). Each file's tests run in one of them, in order
# (pytest_xdist_make_scheduler below), so a module's fixtures (a reference run, a Slurm cluster, the digits)
# are made once. The files that make network namespaces share one process: test_slurm's cluster checks that
# /etc/hosts and the namespace folder are as it found them, which another file's namespaces coming and going
# would change.
SHARED_GROUPS = {"tests/cluster/test_slurm.py": "namespaces", "tests/cluster/test_scaling_validation.py": "namespaces",
                 "tests/e2e/test_fault_tolerance.py": "namespaces"}


def group_of(file: str) -> str:
    """The group of tests (a file, or SHARED_GROUPS') that one test process runs, in order."""
    return SHARED_GROUPS.get(file, file)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler by file, where the files of a SHARED_GROUPS group are one unit (its
    --dist loadgroup marks its own groups by renaming the tests, which pytest 9.2's node ids no longer
    allow: with pytest-xdist 3.8 a file's tests ran in both processes)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]  # relative to tests/, the root pytest.ini makes
            return group_of(file if file.startswith("tests/") else f"tests/{file}")

    return FileGroups(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped, with the reason shown, where there is none. The groups with
    the most slow tests come first, so that the two test processes start on the long work and
    neither is left with a long file at the end (the scheduler keeps this order:
    --no-loadscope-reorder)."""
    import torch

    groups = {item: group_of(_file_of(item)) for item in items}
    slow_tests = {}
    for item, group in groups.items():
        slow_tests[group] = slow_tests.get(group, 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: -slow_tests[groups[item]])  # stable: each file keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _file_of(item) -> str:
    return Path(item.fspath).resolve().relative_to(Path(__file__).resolve().parent.parent).as_posix()


@pytest.fixture(autouse=True, scope="session")
def _file_list_cache_in_tmp(tmp_path_factory):
    """The runs' scans are cached in the user's cache folder (common.dataset_lists.cache_file): a
    temporary one for the tests and the scripts they start, not the tester's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))

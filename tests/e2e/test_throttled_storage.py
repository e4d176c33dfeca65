"""The kernel-throttled storage of the bench's storage section
(common/tools/bench/throttled_storage.py), for real: a loop-mounted ext4
image under a cgroup read limit. Reading N small files under an IOPS cap
takes about N / IOPS seconds, a large file under a bandwidth cap about its
size over the cap; the same reads outside the group are not held; the
loop device, mount, group and image are gone afterwards, after a failure too.
Needs root, loop devices and a cgroup read throttle: skipped elsewhere, with
the reason. Bounds are one-sided where a loaded machine could break them
(a throttle cannot make a read faster than its cap; a slow machine only
makes it slower), with a generous upper bound."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.tools.bench import throttled_storage
from common.tools.bench.throttled_storage import ThrottledStorage

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(throttled_storage.unavailable()),
                                                   reason=throttled_storage.unavailable() or "available")]

READ_IOPS, READ_BYTES_PER_SECOND = 200, 10_000_000
SMALL_FILES, SMALL_FILE_BYTES, LARGE_FILE_BYTES = 200, 20_000, 20_000_000
# Reads every file of a folder (or one file) and prints the seconds it took and the bytes read.
READER = """import os, sys, time
started, total = time.monotonic(), 0
target = sys.argv[1]
for name in (sorted(os.listdir(target)) if os.path.isdir(target) else [""]):
    with open(os.path.join(target, name) if name else target, "rb") as handle:
        total += len(handle.read())
print(time.monotonic() - started, total)"""


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    with ThrottledStorage(tmp_path_factory.mktemp("throttled"), 256 * 2**20, read_iops=READ_IOPS,
                          read_bytes_per_second=READ_BYTES_PER_SECOND) as storage:
        files = storage.mount_point / "small"
        files.mkdir()
        for index in range(SMALL_FILES):
            (files / f"{index:04d}.bin").write_bytes(os.urandom(SMALL_FILE_BYTES))
        (storage.mount_point / "large.bin").write_bytes(os.urandom(LARGE_FILE_BYTES))
        yield storage


def _timed_read(storage: ThrottledStorage, target: Path, throttled: bool):
    throttled_storage.drop_caches()
    done = subprocess.run([sys.executable, "-c", READER, str(target)], capture_output=True, text=True,
                          preexec_fn=storage.enter if throttled else None, timeout=300)
    assert done.returncode == 0, done.stderr
    seconds, total = done.stdout.split()
    return float(seconds), int(total)


def test_small_files_under_an_iops_cap_take_about_n_over_iops_seconds(storage):
    expected = SMALL_FILES / READ_IOPS  # at least one read a file: 1.0 s
    seconds, total = _timed_read(storage, storage.mount_point / "small", throttled=True)
    assert total == SMALL_FILES * SMALL_FILE_BYTES
    assert 0.5 * expected <= seconds <= 10 * expected + 5, seconds
    unthrottled, _ = _timed_read(storage, storage.mount_point / "small", throttled=False)
    assert unthrottled < seconds, (unthrottled, seconds)


def test_a_large_file_under_a_bandwidth_cap_reads_at_about_the_cap(storage):
    expected = LARGE_FILE_BYTES / READ_BYTES_PER_SECOND  # 2.0 s
    seconds, total = _timed_read(storage, storage.mount_point / "large.bin", throttled=True)
    assert total == LARGE_FILE_BYTES
    assert 0.5 * expected <= seconds <= 10 * expected + 5, seconds


def _loop_devices() -> str:
    return subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], capture_output=True,
                          text=True).stdout


def test_everything_set_up_is_torn_down_after_a_failure_inside(tmp_path):
    with pytest.raises(KeyError, match="inside"):
        with ThrottledStorage(tmp_path, 64 * 2**20, read_iops=100) as storage:
            device, group, image = storage.device, storage.group, storage.image
            assert str(image) in _loop_devices() and group.is_dir() and os.path.ismount(storage.mount_point)
            storage.enter(os.getpid())  # a member the teardown must move out before the group can go
            try:
                raise KeyError("inside")
            finally:
                assert f"{os.getpid()}" in (group / "cgroup.procs").read_text().split()
    assert str(image) not in _loop_devices(), (device, _loop_devices())
    assert not group.exists() and not image.exists() and not storage.mount_point.exists()

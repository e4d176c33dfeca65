"""Slow storage made by the kernel, not by sleeps in Python: a loop-mounted
ext4 image whose reads are throttled by a cgroup (v1 blkio's
throttle.read_iops_device / read_bps_device; cgroup v2's io.max where the
v2 hierarchy has the io controller and v1 has no blkio), for the bench's
storage section and the tests.

    with ThrottledStorage(folder, size_bytes=2**30, read_iops=1000, read_bytes_per_second=200e6) as storage:
        ...write files under storage.mount_point...
        drop_caches()                               # before each measured read
        subprocess.run(command, preexec_fn=storage.enter)   # the reader, and workers it forks, throttled

The throttle holds for the processes in the group (storage.enter moves the
calling process in; data-loading workers forked from it inherit it), on
reads of the loop device only. Page-cache hits are not throttled: hence
drop_caches (the whole machine's clean pages) before each measured read.
Setting up needs root, losetup, mkfs.ext4 and mount: unavailable() says in
one line what is missing, and tests skip with it. Leaving the context always
tears down whatever was set up (the group, the mount, the loop device, the
image), in reverse order, even after a failure.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

CGROUP_V1_BLKIO = Path("/sys/fs/cgroup/blkio")
CGROUP_V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")
# The storage profile: a shared file system's share for one reader, about 1,000 read IOPS and 200 MB/s.
PROFILE_READ_IOPS = 1000
PROFILE_READ_BYTES_PER_SECOND = 200_000_000


def _cgroup_v2_io_root() -> Optional[Path]:
    """The cgroup v2 hierarchy whose children may get the io controller, if any."""
    for root in CGROUP_V2_ROOTS:
        try:
            if "io" in (root / "cgroup.controllers").read_text().split():
                return root
        except OSError:
            continue
    return None


def unavailable() -> str:
    """Why a throttled storage cannot be set up here, in one line; '' when it can."""
    if os.geteuid() != 0:
        return "throttled storage needs root (a loop device, a mount and a cgroup)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"throttled storage needs {', '.join(missing)} (util-linux, e2fsprogs)"
    if not Path("/dev/loop-control").exists():
        return "throttled storage needs loop devices (/dev/loop-control is missing)"
    if not (CGROUP_V1_BLKIO / "blkio.throttle.read_iops_device").exists() and _cgroup_v2_io_root() is None:
        return ("throttled storage needs cgroup v1's blkio throttle or cgroup v2's io controller; neither is "
                "mounted here")
    return ""


def drop_caches() -> bool:
    """Write back dirty pages, then drop the page cache, dentries and inodes
    (the whole machine's clean ones): the next read comes from the device.
    False (nothing dropped) where this process may not (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def _run(command: List[str]) -> str:
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}): {done.stdout.strip()[-500:]}")
    return done.stdout.strip()


class ThrottledStorage(contextlib.AbstractContextManager):
    """An ext4 file system of `size_bytes` in an image under `folder`, mounted
    at folder/mnt, its reads capped at `read_iops` and `read_bytes_per_second`
    (None: that one not capped) for the processes in its cgroup."""

    def __init__(self, folder: Path, size_bytes: int, read_iops: Optional[int] = None,
                 read_bytes_per_second: Optional[int] = None):
        self.folder = Path(folder).resolve()
        self.size_bytes = -(-size_bytes // 2**20) * 2**20  # whole MiB: a loop device takes whole sectors
        self.read_iops = read_iops
        self.read_bytes_per_second = read_bytes_per_second
        self.image = self.folder / "throttled.img"
        self.mount_point = self.folder / "mnt"
        self.device: Optional[str] = None
        self.group: Optional[Path] = None
        self._mounted = False
        self._cgroup_v1 = (CGROUP_V1_BLKIO / "blkio.throttle.read_iops_device").exists()

    def __enter__(self) -> "ThrottledStorage":
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        try:
            self._set_up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _set_up(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as handle:
            handle.truncate(self.size_bytes)  # sparse: disk is taken only by what is written
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(self.image)])
        self.device = _run(["losetup", "--find", "--show", str(self.image)]).splitlines()[-1]  # after any warning
        self.mount_point.mkdir(exist_ok=True)
        _run(["mount", "-o", "noatime", self.device, str(self.mount_point)])
        self._mounted = True
        rdev = os.stat(self.device).st_rdev
        self._make_group(f"{os.major(rdev)}:{os.minor(rdev)}")

    def _make_group(self, device_number: str) -> None:
        """The cgroup whose members' reads of the loop device are capped."""
        if self._cgroup_v1:
            self.group = CGROUP_V1_BLKIO / f"throttled-storage-{os.getpid()}-{id(self)}"
            self.group.mkdir()
            if self.read_iops:
                (self.group / "blkio.throttle.read_iops_device").write_text(f"{device_number} {self.read_iops}")
            if self.read_bytes_per_second:
                (self.group / "blkio.throttle.read_bps_device").write_text(
                    f"{device_number} {self.read_bytes_per_second}")
            return
        root = _cgroup_v2_io_root()
        with contextlib.suppress(OSError):  # already enabled, or enabled by its parent's manager
            (root / "cgroup.subtree_control").write_text("+io")
        self.group = root / f"throttled-storage-{os.getpid()}-{id(self)}"
        self.group.mkdir()
        limits = " ".join(filter(None, (self.read_iops and f"riops={self.read_iops}",
                                        self.read_bytes_per_second and f"rbps={self.read_bytes_per_second}")))
        if limits:
            (self.group / "io.max").write_text(f"{device_number} {limits}")

    def enter(self, pid: int = 0) -> None:
        """Move process `pid` (0: the calling one) into the throttled group;
        its children forked later are in it too. As a Popen preexec_fn, the
        child is in the group before it runs anything."""
        (self.group / "cgroup.procs").write_text(str(pid or os.getpid()))

    def _release_group(self) -> None:
        """Members moved back to the root group, then the group removed (a cgroup with members cannot be)."""
        root = self.group.parent
        with contextlib.suppress(OSError):
            for pid in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # gone meanwhile
                    (root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.group.rmdir()
        self.group = None

    def __exit__(self, *exc_info) -> None:
        """Whatever was set up, undone in reverse order; each step tried even if one before it failed."""
        problems = []
        if self.group is not None:
            self._release_group()
        if self._mounted:
            try:
                _run(["umount", str(self.mount_point)])
            except RuntimeError as error:  # busy: a reader still holds a file; detached now, freed when it closes
                problems.append(str(error))
                subprocess.run(["umount", "--lazy", str(self.mount_point)], capture_output=True)
            self._mounted = False
        if self.device is not None:
            subprocess.run(["losetup", "--detach", self.device], capture_output=True)
            self.device = None
        with contextlib.suppress(OSError):
            self.mount_point.rmdir()
        with contextlib.suppress(OSError):
            self.image.unlink()
        if problems and exc_info[0] is None:
            raise RuntimeError("; ".join(problems))

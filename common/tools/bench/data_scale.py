"""The benchmark's data-scale section (python -m common.tools.bench
--sections data-scale): what a dataset of ImageNet's size costs before the
first image is read, measured on a tree of ImageNet's shape (1,000 classes x
1,281 files) whose files are hard links to 64 tiny JPEGs, so the tree takes
a few MB of disk and seconds to build. Against a 1,000-image tree of the same
classes, it reports the time of a short run of imagenet_nd.py (on the large
tree a first start, which scans DATA, and a restart that reads the cached
scan; on the small one a restart), the file list's
memory in each process, and what a forked data-loading worker copies of it
by reading every sample once (an epoch); the last two also for the list of
(path, class) tuples the samples were held in before common.dataset_lists.
The lines that hold these rows against the targets are targets.data_scale_lines.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import List

from PIL import Image

from common.errors import UsageError
from common.files import room_at

REPO = Path(__file__).resolve().parents[3]
MIB = 2 ** 20
DIRECTORY_ENTRY_BYTES = 64  # a link's entry in its folder, rounded up (ext4: 8 bytes and the name, 4-aligned)
SOURCES = 64  # tiny JPEGs the tree's files link to: 20,000 links each at ImageNet's size (ext4 allows 65,000)


def hardlinked_tree(folder: Path, classes: int, per_class: int) -> Path:
    """folder/hardlinked-<classes>x<per_class>/{train,val}/n<class>/... (val:
    one file per class), every file a hard link to one of SOURCES tiny JPEGs
    kept in the tree's hidden .sources/ (which scans skip). Built under a
    temporary name and renamed when complete; a finished tree is reused."""
    root = folder / f"hardlinked-{classes}x{per_class}"
    if root.is_dir():
        return root
    # Checked before a link is made, in arithmetic whatever the counts: a link takes a directory entry, a
    # class its two folders' inodes.
    links, free_bytes, free_inodes = classes * (per_class + 1), *room_at(folder)
    if links * DIRECTORY_ENTRY_BYTES > free_bytes or 2 * classes + SOURCES > free_inodes:
        raise UsageError(f"argument --data-scale: {classes:,} x {per_class:,} training images need {links:,} links "
                         f"in {2 * classes:,} folders, more than {folder} has room for ({free_bytes:,} bytes and "
                         f"{free_inodes:,} inodes free)")
    building = folder / f".{root.name}.building-{os.getpid()}"
    try:
        (building / ".sources").mkdir(parents=True)
        sources = []
        for index in range(SOURCES):
            sources.append(building / ".sources" / f"{index}.JPEG")
            Image.new("RGB", (16, 16), (4 * index, 255 - 4 * index, 128)).save(sources[-1], quality=90)
        total, made, started = classes * (per_class + 1), 0, time.monotonic()
        for split, count in (("train", per_class), ("val", 1)):
            for label in range(classes):
                class_dir = building / split / f"n{label:08d}"
                class_dir.mkdir(parents=True)
                for index in range(count):
                    os.link(sources[(label * count + index) % SOURCES], class_dir / f"n{label:08d}_{index}.JPEG")
                made += count
                if label % max(1, classes // 10) == 0 and split == "train" and total > 100_000:
                    print(f"  building {root.name}: {made:,} of {total:,} links "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
        os.rename(building, root)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # a tree left half-built (an error, Ctrl-C)
    return root


def run_seconds(data: Path, logdir: Path, batch_size: int) -> float:
    """Wall time of imagenet_nd.py to the end of a 2-step epoch on `data`
    (ResNet-18 at 16 px on the CPU: the list and the start-up, not the
    arithmetic), writing into `logdir` and caching its scan there too (as its
    XDG_CACHE_HOME): a first start in a new `logdir` scans DATA."""
    command = [sys.executable, "imagenet_nd.py", str(data), "-a", "resnet18", "--image-size", "16",
               "--val-resize", "16", "-b", str(batch_size), "-j", "0", "--device", "cpu", "--epochs", "1",
               "--steps-per-epoch", "2", "--checkpoint-every", "0", "--io-interval", "0", "-p", "1000000",
               "--logdir", str(logdir)]
    started = time.monotonic()
    completed = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "XDG_CACHE_HOME": str(logdir / "cache")})
    seconds = time.monotonic() - started
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed (exit {completed.returncode}): "
                           f"{completed.stdout[-2000:]}")
    return seconds


def list_costs(data: Path) -> List[dict]:
    """The training list of `data`, as FileList and as the list of tuples it
    replaced: its memory, and what a forked reader of every sample copies."""
    from common.dataset_lists import scan_split
    from common.measure import bytes_a_forked_reader_copies

    _, compact = scan_split(data / "train")
    tracemalloc.start()
    tuples = list(compact)
    tuples_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rows = []
    for name, samples, size in (("FileList", compact, compact.nbytes), ("list of tuples (before)", tuples,
                                                                         tuples_bytes)):
        copied = bytes_a_forked_reader_copies(samples) / MIB if os.path.exists("/proc/self/smaps_rollup") else ""
        rows.append({"config": f"{len(compact):,} images, the list as {name}", "list_mib": size / MIB,
                     "worker_copied_mib": copied, "note": "" if copied != "" else "a worker's copy: Linux only"})
    return rows


def data_scale_rows(cache: Path, classes: int, per_class: int) -> List[dict]:
    """The section's rows: section, config, and seconds, or list_mib and
    worker_copied_mib. The trees are built once into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    large = hardlinked_tree(cache, classes, per_class)
    small = hardlinked_tree(cache, classes, 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-scale-") as logdir:
        try:  # not timed: what the first run loads (a run that fails says so in the rows below)
            run_seconds(small, Path(logdir, small.name), min(32, classes))
        except RuntimeError:
            pass
        for tree, runs in ((small, ("restart (cached scan)",)),
                           (large, ("first start (scans DATA)", "restart (cached scan)"))):
            images = classes * (1 if tree == small else per_class)
            for run in runs:
                try:
                    rows.append({"config": f"{images:,} images, {run}",
                                 "seconds": run_seconds(tree, Path(logdir, tree.name), min(32, classes))})
                    print(f"data-scale {rows[-1]['config']}: {rows[-1]['seconds']:.1f} s", flush=True)
                except RuntimeError as error:  # the row says why; the section goes on
                    rows.append({"config": f"{images:,} images, {run}", "note": str(error)[:500]})
                    print(f"data-scale {rows[-1]['config']}: {rows[-1]['note']}", flush=True)
    for row in list_costs(large):
        rows.append(row)
        copied = row["note"] or f"a forked reader of every sample copies {row['worker_copied_mib']:.1f} MiB"
        print(f"data-scale {row['config']}: {row['list_mib']:.1f} MiB, {copied}", flush=True)
    return [{"section": "data-scale", "data_backend": "", "workers": 0, **row} for row in rows]

"""The benchmark's storage section (python -m common.tools.bench --sections
storage): where the bytes of an epoch come from, and how fast, on the same
ImageNet-shaped JPEGs as the input section: the folder tree, its shards
(common.tools.pack_shards), the shards through an S3 object store (moto's
server on loopback) and through a warm node-local cache (--data-cache), each
on local disk and on storage throttled by the kernel to about 1,000 read
IOPS and 200 MB/s (throttled_storage: a loop-mounted ext4 image under a
cgroup read limit; root only, else those rows say why).

What is timed is the read stage: the bytes of every training image, in the
order an epoch reads them (TrainSampler's full permutation), by the
data-loading workers the trainer would use (Settings.data_workers), each
measurement a fresh process after the page cache was dropped
(measurements.measure_storage_read). Decoding is timed apart, on local disk
(the `decoded` rows: the input section's torchvision pipeline on the tree
and on the shards): on a 2-core machine decoding caps every row at the same
few hundred images/s, so only the read stage compares storage. Files opened
per second are counted in the measured processes (measurements.OpenCounter:
the opens under the data's folder and the cache's); a shard reader opens each
shard once per process, an object store none (HTTP range requests).
"""
from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path
from typing import Callable, List, Optional

from common.tools.bench import storage_setup, throttled_storage
from common.tools.bench.processes import ChildFailed, run_child
from common.tools.bench.repeats import Planned, measure_section
from common.tools.bench.settings import Settings

LOCAL = "local disk"
THROTTLED = (f"throttled: {throttled_storage.PROFILE_READ_IOPS:,} read IOPS, "
             f"{throttled_storage.PROFILE_READ_BYTES_PER_SECOND / 1e6:.0f} MB/s")
# (config, format, read order, where its bytes are): the read-stage rows, on each storage profile.
READ_CONFIGS = (
    ("folder tree", "folder", "permutation", "tree"),
    ("shards", "shards", "permutation", "shards"),
    ("shards, in shard order (a sequential reader such as webdataset)", "shards", "shard", "shards"),
    ("shards through the object store", "shards", "permutation", "object store"),
    ("shards, warm node-local cache", "shards", "permutation", "cache"),
)
IN_MEMORY_SERVER = "not measured: moto's server holds its objects in memory, no disk to throttle"


def _measured_read(spec: dict, storage: Optional[throttled_storage.ThrottledStorage]) -> dict:
    """One read-stage measurement in a fresh process, after the page cache was dropped (as root); throttled
    when `storage` is given."""
    throttled_storage.drop_caches()
    return run_child(spec, preexec_fn=storage.enter if storage is not None else None)


def _warm_cache(spec: dict, storage: Optional[throttled_storage.ThrottledStorage]) -> str:
    """One unmeasured epoch through a fresh node-local cache, which copies every shard in;
    '' when done, else the row's note."""
    shutil.rmtree(spec["cache"], ignore_errors=True)
    try:
        run_child(spec, preexec_fn=storage.enter if storage is not None else None)
    except ChildFailed as error:
        return f"not measured: the cache's first epoch failed: {error.reason}"
    return ""


def _read_rows(settings: Settings, folder: Path, places: dict, storage, profile: str) -> List[Planned]:
    """The read-stage configurations of one storage profile. `places`: where
    each kind of bytes is ({'tree', 'shards', 'object store'} -> (data,
    endpoint URL, why not))."""
    planned = []
    for config, data_format, order, where in READ_CONFIGS:
        data, endpoint_url, problem = places["shards" if where == "cache" else where]
        if where == "object store" and storage is not None:
            problem = problem or IN_MEMORY_SERVER
        spec = {"kind": "storage-read", "data": data, "format": data_format, "order": order,
                "endpoint_url": endpoint_url or None, "batch_size": settings.batch_size,
                "workers": settings.data_workers}
        if where == "object store":
            spec["environment"] = storage_setup.MOTO_ENVIRONMENT
        if where == "cache" and not problem:
            spec["cache"] = str(folder / f"node-cache-{'throttled' if storage is not None else 'local'}")
            problem = _warm_cache(spec, storage)
        fields = dict(section="storage", config=config, storage=profile, data_backend="", workers=spec["workers"],
                      batch_size=settings.batch_size, command=f"measurements.measure_storage_read ({order} order)",
                      note=problem)
        planned.append(Planned(f"{config} ({profile})", fields,
                               None if problem else functools.partial(_measured_read, spec, storage)))
    return planned


def _decoded_rows(settings: Settings, places: dict) -> List[Planned]:
    """The decoded pipeline (the input section's torchvision backend) on the tree and on the shards, local disk."""
    planned = []
    for name, where in (("decoded: folder tree", "tree"), ("decoded: shards", "shards")):
        data, _, problem = places[where]
        spec = {"kind": "input", "backend": "torchvision", "root": data, "workers": settings.data_workers,
                "image_size": settings.image_size, "batch_size": settings.batch_size,
                "batches": settings.input_batches, "device": settings.device}
        fields = dict(section="storage", config=name, storage=LOCAL, data_backend="torchvision",
                      workers=spec["workers"], batch_size=settings.batch_size, image_size=settings.image_size,
                      command=f"--data-backend torchvision -j {spec['workers']}", note=problem)
        planned.append(Planned(name, fields, None if problem else functools.partial(_measured_read, spec, None)))
    return planned


def storage_section(settings: Settings, folder: Path, tree: str,
                    save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """Every row of the section, settings.input_repeats times round-robin.
    The shards are packed once into `folder`; the object store and the
    throttled file system live while the section runs."""
    folder, tree = folder.resolve(), str(Path(tree).resolve())  # the measured processes run from the repository
    folder.mkdir(parents=True, exist_ok=True)
    shards = folder / f"shards-{Path(tree).name}"
    unpacked = storage_setup.pack(tree, shards)
    print(f"storage: {tree} and its shards ({unpacked or shards}); throttled profile: "
          f"{throttled_storage.unavailable() or THROTTLED}", flush=True)
    serving = storage_setup.object_store(shards) if not unpacked else contextlib.nullcontext(
        storage_setup.ObjectStore("", "", unpacked))
    with serving as object_store, storage_setup.throttled_copy(
            folder / "throttled", throttled_storage.PROFILE_READ_IOPS,
            throttled_storage.PROFILE_READ_BYTES_PER_SECOND, Path(tree), None if unpacked else shards) as storage:
        local = {"tree": (tree, "", ""), "shards": (str(shards), "", unpacked),
                 "object store": (object_store.data, object_store.endpoint_url, object_store.problem)}
        planned = _read_rows(settings, folder, local, None, LOCAL)
        if storage is None:
            reason = f"not measured: {throttled_storage.unavailable()}"
            planned += [Planned(config, dict(section="storage", config=config, storage=THROTTLED, note=reason), None)
                        for config, *_ in READ_CONFIGS]
        else:
            throttled = {"tree": (str(storage.mount_point / Path(tree).name), "", ""),
                         "shards": (str(storage.mount_point / shards.name), "", unpacked),
                         "object store": local["object store"]}
            planned += _read_rows(settings, folder, throttled, storage, THROTTLED)
        planned += _decoded_rows(settings, local)
        return measure_section(planned, settings.input_repeats, settings, save)

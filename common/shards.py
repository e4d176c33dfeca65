"""Sharded datasets: a train/val tree packed into tar shards by
`python -m common.tools.pack_shards DATA OUT`, read back by random access.

OUT holds manifest.json (the format and its version, the classes in order,
per split the image and per-class counts, each shard's name, bytes, images
and sha256, the index file's name and sha256, the encoding, the source), the
shards train-NNNNNN.tar and val-NNNNNN.tar (WebDataset's layout: members
KEY.jpg, the image's bytes, and KEY.cls, its class index in ASCII, so
webdataset and DALI's fn.readers.webdataset read them as they are) and one
index per split, SPLIT-index.npz: for each dataset index (the order of the
folder tree's scan, common.dataset_lists.scan_dataset) its shard, the byte
offset and size of its image inside it, its class, the crc32 of those bytes
and its source-relative path.

A training run reads image `index` as one byte range of one shard through a
common.storage.Store, so the samplers of common.data, --bad-images and the
per-class report work on shards as on files, and a run on a tree's shards
draws the same images and crops as the run on the tree: it ends on the same
weights. Inside the tars the training images are in a seeded shuffled order,
for readers that stream a shard from start to end.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zlib
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from common.config import MANIFEST_NAME, is_sharded  # torch-free, for the command line; part of this API
from common.dataset_lists import SPLITS, unpack_one
from common.distributed import Context, decided_by_primary
from common.errors import UsageError
from common.image_files import BadImageError
from common.storage import Fetched, MissingObject, Store, open_store, with_cache

__all__ = ["MANIFEST_NAME", "is_sharded", "ShardedSplit", "ShardedDataset", "open_sharded", "verify", "read_manifest"]

FORMAT_NAME = "imagenet-reference-shards"
FORMAT_VERSION = 1
INDEX_FIELDS = ("shard", "offset", "size", "label", "crc32", "path_bytes", "path_ends")
VERIFY_COMMAND = "python -m common.tools.pack_shards --verify"


def index_name(split: str) -> str:
    return f"{split}-index.npz"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


class ShardedSplit(Sequence):
    """One split of a sharded dataset: image `index` is bytes
    offset[index]:offset[index] + size[index] of shard shard[index]. A
    sequence of (name, class index), as common.dataset_lists.FileList is, so
    the code that names images (bad_images.csv, --data-timeout's line) reads
    it alike. Picklable into data-loading workers: numpy arrays and the
    store, which opens its files in each process."""

    def __init__(self, store: Store, shards: List[str], arrays: Mapping[str, np.ndarray]):
        self.store = store
        self.shards = shards
        self.arrays = {field: arrays[field] for field in INDEX_FIELDS}

    def __len__(self) -> int:
        return len(self.arrays["label"])

    def label(self, index: int) -> int:
        return int(self.arrays["label"][index])

    def path(self, index: int) -> str:
        """The image's path in the source tree, relative to it (train/<class>/<file>)."""
        return unpack_one(self.arrays["path_bytes"], self.arrays["path_ends"], index).decode("utf-8", "surrogateescape")

    def shard(self, index: int) -> str:
        return self.shards[int(self.arrays["shard"][index])]

    def name(self, index: int) -> str:
        """The image for messages: its source path and the shard holding it."""
        return f"{self.path(index)} (in {self.shard(index)})"

    def __getitem__(self, index: int) -> Tuple[str, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        index %= len(self)
        return self.name(index), self.label(index)

    def read(self, index: int) -> Fetched:
        """The image's bytes; a crc32 other than the index's is a BadImageError
        (--bad-images skip|fail decide, as for an unreadable file)."""
        shard = self.shard(index)
        fetched = self.store.read(shard, int(self.arrays["offset"][index]), int(self.arrays["size"][index]))
        expected = int(self.arrays["crc32"][index])
        found = zlib.crc32(fetched.data)
        if found != expected:
            reason = f"damaged in {shard}: crc32 {found:08x}, its index says {expected:08x}"
            raise BadImageError(f"{self.name(index)}: cannot decode image ({reason}); pack DATA again, or pass "
                                f"--bad-images skip", reason=reason)
        return fetched


@dataclasses.dataclass
class ShardedDataset:
    classes: List[str]
    train: ShardedSplit
    val: ShardedSplit
    manifest: dict
    store: Store

    def describe(self) -> str:
        """One note for the run's start: what is read, and from where."""
        shards = sum(len(self.manifest["splits"][split]["shards"]) for split in SPLITS)
        encoding = self.manifest["encoding"]
        side = f"longest side {encoding.get('max_side')} px, " if encoding.get("max_side") else ""
        stored = ("as packed from the source" if encoding["kind"] == "as-is" else
                  f"re-encoded ({side}JPEG quality {encoding['jpeg_quality']})")
        return f"shards: {shards} in {self.store.describe()}, images {stored}"


def read_manifest(store: Store) -> dict:
    """The manifest of the shards in `store`, its format checked."""
    try:
        manifest = json.loads(store.read(MANIFEST_NAME).data)
    except MissingObject:
        raise UsageError(f"DATA {store.location}: no {MANIFEST_NAME} (python -m common.tools.pack_shards DATA OUT "
                         f"writes shards and their manifest)") from None
    except ValueError as error:
        raise UsageError(f"DATA {store.location}: {MANIFEST_NAME} is not valid JSON ({error})") from None
    found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else (None, None)
    if found != (FORMAT_NAME, FORMAT_VERSION):
        raise UsageError(f"DATA {store.location}: {MANIFEST_NAME} is no manifest this version reads (format "
                         f"{found[0]!r} version {found[1]!r}; expected {FORMAT_NAME!r} version {FORMAT_VERSION})")
    return manifest


def expected_shards(manifest: dict) -> Dict[str, Tuple[int, str]]:
    """{shard name: (bytes, sha256)} of every shard the manifest lists."""
    return {shard["name"]: (shard["bytes"], shard["sha256"])
            for split in SPLITS for shard in manifest["splits"][split]["shards"]}


def check_shard_sizes(store: Store, manifest: dict) -> None:
    """Every shard present with the manifest's size: a missing or cut shard
    is one line naming it, before training starts."""
    for name, (size, _) in expected_shards(manifest).items():
        found = store.size(name)  # MissingObject names it
        if found != size:
            raise UsageError(f"DATA {store.location}: shard {name} is {found:,} bytes, its manifest says {size:,} "
                             f"(damaged or partly copied; {VERIFY_COMMAND} {store.location} checks every shard)")


def read_index(store: Store, manifest: dict, split: str) -> Dict[str, np.ndarray]:
    """A split's index arrays, its sha256 checked against the manifest's."""
    entry = manifest["splits"][split]["index"]
    data = store.read(entry["name"]).data
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise UsageError(f"DATA {store.location}: {entry['name']} differs from its manifest's sha256 (damaged; pack "
                         f"DATA again or copy the file again)")
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        loaded = {field: arrays[field] for field in INDEX_FIELDS}
    if len(loaded["label"]) != manifest["splits"][split]["images"]:
        raise UsageError(f"DATA {store.location}: {entry['name']} lists {len(loaded['label']):,} images, its manifest "
                         f"{manifest['splits'][split]['images']:,}")
    return loaded


def read_catalogue(store: Store) -> Tuple[dict, Dict[str, Dict[str, np.ndarray]]]:
    """The manifest, checked against the store's shards, and both indexes."""
    manifest = read_manifest(store)
    check_shard_sizes(store, manifest)
    return manifest, {split: read_index(store, manifest, split) for split in SPLITS}


def open_sharded(data: str, cache_dir: Optional[str] = None, cache_bytes: int = 0,
                 endpoint_url: Optional[str] = None, ctx: Optional[Context] = None) -> ShardedDataset:
    """The sharded dataset at `data` (a folder, or s3://bucket/prefix), read
    through the node-local cache in `cache_dir` when given. With `ctx`, the
    primary alone reads the manifest and indexes, and checks the shards'
    sizes, and every process gets them (decided_by_primary, as find_lists
    does with a scan): two reads and one look per shard per job, not per
    process, on the shared storage that sharding spares."""
    source = open_store(data, endpoint_url)
    manifest, indexes = (decided_by_primary(lambda: read_catalogue(source), ctx) if ctx is not None
                         else read_catalogue(source))
    store = with_cache(source, cache_dir, cache_bytes, expected_shards(manifest))
    splits = {split: ShardedSplit(store, [shard["name"] for shard in manifest["splits"][split]["shards"]],
                                  indexes[split]) for split in SPLITS}
    return ShardedDataset(list(manifest["classes"]), splits["train"], splits["val"], manifest, store)


def verify(store: Store) -> List[str]:
    """Every shard and index read whole and checked against the manifest's
    size and sha256: the problems, one phrase each (none: all sound)."""
    manifest = read_manifest(store)
    wanted = dict(expected_shards(manifest))
    wanted.update({manifest["splits"][split]["index"]["name"]: (None, manifest["splits"][split]["index"]["sha256"])
                   for split in SPLITS})
    problems = []
    for name, (size, sha256) in wanted.items():
        try:
            found = store.size(name)
        except MissingObject:
            problems.append(f"{name} missing")
            continue
        if size is not None and found != size:
            problems.append(f"{name} is {found:,} bytes, not {size:,}")
        elif stored_sha256(store, name, found) != sha256:
            problems.append(f"{name} differs from its sha256")
    return problems


def stored_sha256(store: Store, name: str, size: int, chunk_bytes: int = 8 << 20) -> str:
    """The sha256 of object `name`, read in chunks: a shard need not fit in memory."""
    digest = hashlib.sha256()
    for offset in range(0, size, chunk_bytes):
        digest.update(store.read(name, offset, min(chunk_bytes, size - offset)).data)
    return digest.hexdigest()

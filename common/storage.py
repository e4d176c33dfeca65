"""Where a sharded dataset's objects live (its manifest, indexes and shards),
and how a data-loading worker reads a byte range of one: a local or shared
directory (LocalStore), an S3-compatible object store (s3://bucket/prefix),
either of them behind a node-local cache (--data-cache).

Every read says where its bytes came from (Fetched): from the source (DATA's
storage: a range of a shard, or a whole shard copied into the cache) or from
the node-local cache. A sample carries both counts (data.Sample), so the
epoch's totals, summed over processes like every other count, say how much
each epoch pulled from the shared storage.

A store is made in the training process and copied into data-loading
workers: it opens files and connections lazily, once per process.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

from common.errors import UsageError


class Fetched(NamedTuple):
    """Bytes read from a store, and where they came from."""

    data: bytes
    source_bytes: int  # read from the source: the range itself, or a whole shard copied into the cache for it
    cache_bytes: int = 0  # read from the node-local cache


class MissingObject(UsageError):
    """An object the manifest names is not in the store (a shard deleted or never uploaded)."""


class Store:
    """Named objects under one location. `location` is what the user gave
    (a folder, or s3://bucket/prefix), never with credentials in it."""

    location: str = ""

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> Fetched:
        """`length` bytes of object `name` from `offset` (all of it when None)."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        """Object `name`'s size in bytes; MissingObject when it is not there."""
        raise NotImplementedError

    def names(self) -> List[str]:
        """Every object's name (relative to the location), sorted."""
        raise NotImplementedError

    def describe(self) -> str:
        """One phrase for the run's notes: where the data comes from."""
        return self.location


class LocalStore(Store):
    """A directory on a local or shared (NFS, Lustre, GPFS) file system.
    Files stay open (one descriptor per shard and process) and are read
    with pread: one open per shard and process, not one per image."""

    def __init__(self, root: str):
        self.location = root
        self._files: Dict[str, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()  # --workers 0: the data-timeout watcher's thread reads beside the loop

    def __getstate__(self):
        return {"location": self.location}  # descriptors stay in the process that opened them

    def __setstate__(self, state):
        self.__init__(state["location"])

    def _descriptor(self, name: str) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors share its file offsets
            self._files, self._pid = {}, os.getpid()
        with self._lock:
            if name not in self._files:
                path = os.path.join(self.location, name)
                try:
                    self._files[name] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise MissingObject(f"DATA {self.location}: {name} is missing (named by its manifest)") from None
            return self._files[name]

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> Fetched:
        descriptor = self._descriptor(name)
        if length is None:
            length = os.fstat(descriptor).st_size - offset
        data = os.pread(descriptor, length, offset)
        return Fetched(data, source_bytes=len(data))

    def size(self, name: str) -> int:
        try:
            return os.stat(os.path.join(self.location, name)).st_size
        except FileNotFoundError:
            raise MissingObject(f"DATA {self.location}: {name} is missing (named by its manifest)") from None

    def names(self) -> List[str]:
        found = []
        for folder, _, files in os.walk(self.location):
            found.extend(os.path.relpath(os.path.join(folder, name), self.location) for name in files)
        return sorted(found)


def is_object_store(location: str) -> bool:
    return location.startswith("s3://")


def open_store(location: str, endpoint_url: Optional[str] = None) -> Store:
    """The store at `location`: a directory, or s3://bucket/prefix (the
    endpoint from `endpoint_url`, else the AWS environment or profile)."""
    if is_object_store(location):
        raise UsageError(f"DATA {location}: object stores are not supported yet")  # S3Store: to come
    return LocalStore(location)


def with_cache(source: Store, directory: Optional[str], cap_bytes: int,
               expected: Mapping[str, Tuple[int, str]]) -> Store:
    """`source` behind the node-local cache in `directory` (--data-cache),
    holding at most `cap_bytes`; `expected`: each shard's (size, sha256)
    from the manifest, checked when a shard is copied in. `source` itself
    when `directory` is None."""
    if directory is None:
        return source
    raise UsageError("argument --data-cache: not supported yet")  # NodeCache: to come

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

import collections
import contextlib
import errno
import re
import fcntl
import glob
import hashlib
import importlib
import os
import sys
import threading
from typing import List, Mapping, NamedTuple, Optional, Tuple
from urllib.parse import urlsplit

from common.config import OBJECT_STORE_SCHEMES
from common.errors import DATA_TIMEOUT_EXIT_STATUS, ReportedError, UsageError, error_summary
from common.files import format_bytes, room_at


class Fetched(NamedTuple):
    """Bytes read from a store, and where they came from."""

    data: bytes
    source_bytes: int  # read from the source: the range itself, or a whole shard copied into the cache for it
    cache_bytes: int = 0  # read from the node-local cache


class MissingObject(UsageError):
    """An object the manifest names is not in the store (a shard deleted or never uploaded)."""

    rank_specific = True  # met by the data-loading process that reads it


class CredentialsRefused(UsageError):
    """The object store refused the credentials (a wrong key or secret, or no
    permission): the user's to fix, in the AWS environment or profile."""

    rank_specific = True


class StorageUnreachable(ReportedError):
    """The storage stopped answering (no connection, timeouts, server errors)
    after botocore's retries: not the user's mistake, and not lasting, so the
    status of a batch that did not come (5); the run continues with --resume
    once the storage answers again."""

    status = DATA_TIMEOUT_EXIT_STATUS


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


# Descriptors of shards one process keeps open, per store: the least recently read are closed past it. ImageNet
# in 100 MB shards is ~1,500 of them, over the usual soft limit of 1,024 descriptors a process.
MAX_OPEN_SHARDS = 128


class OpenFiles:
    """A process's open descriptors by name, at most `limit` of them (the
    least recently used closed first). A forked child closes its copies of
    its parent's and opens its own."""

    def __init__(self, limit: int = MAX_OPEN_SHARDS):
        self.limit = limit
        self._open: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._pid = os.getpid()

    def get(self, name: str) -> Optional[int]:
        if self._pid != os.getpid():
            self.close()
            self._pid = os.getpid()
        descriptor = self._open.get(name)
        if descriptor is not None:
            self._open.move_to_end(name)
        return descriptor

    def add(self, name: str, descriptor: int) -> None:
        self._open[name] = descriptor
        while len(self._open) > self.limit:
            os.close(self._open.popitem(last=False)[1])

    def close(self) -> None:
        while self._open:
            with contextlib.suppress(OSError):
                os.close(self._open.popitem()[1])


def open_read_only(path: str, location: str, name: str) -> Optional[int]:
    """A descriptor of `path` (object `name` of `location`), None when it does not exist; any other
    failure (permissions, too many open files, a stale NFS handle) one line naming it."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise UsageError(f"DATA {location}: cannot open {name} ({path}: {error.strerror or error})") from None


class LocalStore(Store):
    """A directory on a local or shared (NFS, Lustre, GPFS) file system.
    Files stay open (one descriptor per shard and process, at most
    MAX_OPEN_SHARDS) and are read with pread: one open per shard and
    process, not one per image."""

    def __init__(self, root: str):
        self.location = root
        self._files = OpenFiles()
        self._lock = threading.Lock()  # --workers 0: the data-timeout watcher's thread reads beside the loop

    def __getstate__(self):
        return {"location": self.location}  # descriptors stay in the process that opened them

    def __setstate__(self, state):
        self.__init__(state["location"])

    def __del__(self):
        self._files.close()

    def _descriptor(self, name: str) -> int:
        with self._lock:
            descriptor = self._files.get(name)
            if descriptor is None:
                descriptor = open_read_only(os.path.join(self.location, name), self.location, name)
                if descriptor is None:
                    raise MissingObject(f"DATA {self.location}: {name} is missing (named by its manifest)")
                self._files.add(name, descriptor)
            return descriptor

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> Fetched:
        descriptor = self._descriptor(name)
        try:
            if length is None:
                length = os.fstat(descriptor).st_size - offset
            data = os.pread(descriptor, length, offset)
        except OSError as error:  # EIO, a stale NFS handle: the storage, not the user (as an object store's)
            raise StorageUnreachable(f"DATA {self.location}: reading {name} failed ({error.strerror or error}); "
                                     f"once it reads again, continue with --resume") from None
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


# An S3 request is retried by botocore's "standard" mode (exponential back-off with jitter: from 0.05 s after an
# error, from 1 s after throttling, at most 20 s). A store that refuses connections ends the read within a second
# or two (measured: 5 attempts in 0.5 s); one that does not answer at all, after S3_ATTEMPTS connect timeouts.
S3_ATTEMPTS = 5
S3_CONNECT_TIMEOUT_S = 10.0
S3_READ_TIMEOUT_S = 30.0
# Answers that say the credentials are wrong or lack a permission (S3's and STS's codes; a HEAD request's answer
# has no body, so botocore's code is its HTTP status: 403).
REFUSED_CREDENTIALS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId",
                       "ExpiredToken", "InvalidToken", "AuthorizationHeaderMalformed", "AllAccessDisabled", "403",
                       "Forbidden")
MISSING = ("NoSuchKey", "NoSuchBucket", "404", "NotFound")
S3_REQUIREMENT = "pip install -r requirements-s3.txt"


def is_object_store(location: Optional[str]) -> bool:
    """Whether DATA (None: --synthetic) is in an object store."""
    return bool(location) and location.startswith(OBJECT_STORE_SCHEMES)


def check_endpoint_url(endpoint_url: str) -> str:
    """An endpoint URL without credentials in it (they belong in the AWS
    environment or profile, never on a command line, in config.json or a log)."""
    parts = urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"argument --s3-endpoint-url: {endpoint_url!r} is no http:// or https:// URL")
    if "@" in parts.netloc:
        raise UsageError(f"argument --s3-endpoint-url: {endpoint_url}: credentials in the URL are refused; "
                         "give them as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or an AWS profile")
    return endpoint_url


class S3Store(Store):
    """Objects under s3://bucket/prefix of an S3-compatible store: a read is
    one ranged GET. boto3 is imported, and its client made, in each process
    at its first request; the credentials are boto3's own search (AWS_*
    variables, AWS_PROFILE, ~/.aws): none is held here, so none is pickled
    into a worker or shown by describe()."""

    def __init__(self, location: str, endpoint_url: Optional[str] = None, attempts: int = S3_ATTEMPTS,
                 connect_timeout_s: float = S3_CONNECT_TIMEOUT_S, read_timeout_s: float = S3_READ_TIMEOUT_S):
        if "@" in location:  # no bucket name holds one; a secret may hold '/' too: the URL is not echoed
            raise UsageError("DATA: an s3:// URL with '@' in it (credentials?) is refused; give them as "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or an AWS profile")
        parts = urlsplit(location)
        if not parts.netloc:
            raise UsageError(f"DATA {location}: no bucket (s3://bucket/prefix)")
        self.location = location.rstrip("/")
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        self.endpoint_url = check_endpoint_url(endpoint_url) if endpoint_url else None
        self.attempts, self.connect_timeout_s, self.read_timeout_s = attempts, connect_timeout_s, read_timeout_s
        self._client, self._pid = None, None
        self._lock = threading.Lock()
        _import_boto3(self.location)  # missing: said now, in the training process, not in a worker

    def __getstate__(self):
        return {key: value for key, value in self.__dict__.items() if key not in ("_client", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _client=None, _pid=None, _lock=threading.Lock())

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def describe(self) -> str:
        return f"{self.location} at {self.endpoint_url or 'the endpoint of the AWS environment'}"

    def _s3(self):
        with self._lock:
            if self._client is None or self._pid != os.getpid():  # a client is not shared across a fork
                boto3, config = _import_boto3(self.location), _import_boto3(self.location, "botocore.config")
                retries = {"mode": "standard", "total_max_attempts": self.attempts}
                settings = config.Config(retries=retries, connect_timeout=self.connect_timeout_s,
                                         read_timeout=self.read_timeout_s)
                self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=settings)
                self._pid = os.getpid()
            return self._client

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> Fetched:
        if length == 0:
            return Fetched(b"", 0)
        last = "" if length is None else offset + length - 1
        ranged = {"Range": f"bytes={offset}-{last}"} if offset or length else {}
        for attempt in range(1, self.attempts + 1):
            with self._answers(name):
                answer = self._s3().get_object(Bucket=self.bucket, Key=self.key(name), **ranged)
            try:
                data = answer["Body"].read()  # botocore retries the request, not a body cut short
                return Fetched(data, source_bytes=len(data))
            except Exception as error:
                if attempt == self.attempts or not _is_transient(error):
                    with self._answers(name):
                        raise
        raise AssertionError("unreachable")

    def size(self, name: str) -> int:
        with self._answers(name):
            return int(self._s3().head_object(Bucket=self.bucket, Key=self.key(name))["ContentLength"])

    def names(self) -> List[str]:
        found = []
        start = f"{self.prefix}/" if self.prefix else ""
        with self._answers(""):
            for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                found.extend(item["Key"][len(start):] for item in page.get("Contents", ()))
        return sorted(found)

    def _answers(self, name: str):
        return _S3Errors(self, name)


class _S3Errors:
    """botocore's errors around one request, as one line naming the object:
    a missing one (MissingObject), refused credentials (CredentialsRefused),
    a store that did not answer through all the retries (StorageUnreachable)."""

    def __init__(self, store: S3Store, name: str):
        self.store, self.name = store, name

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or isinstance(error, ReportedError):
            return False
        exceptions = _import_boto3(self.store.location, "botocore.exceptions")
        where = f"s3://{self.store.bucket}/{self.store.key(self.name)}"
        endpoint = self.store.endpoint_url or "the AWS endpoint"
        if isinstance(error, exceptions.ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in MISSING:
                raise MissingObject(f"DATA {self.store.location}: {where} is missing "
                                    f"({code} from {endpoint})") from None
            if code in REFUSED_CREDENTIALS:
                raise CredentialsRefused(
                    f"DATA {self.store.location}: {endpoint} refused the credentials reading {where} ({code}); "
                    "check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the bucket's "
                    "permissions") from None
            reason = f"{code}: {error_summary(error)}"
        elif isinstance(error, (exceptions.NoCredentialsError, exceptions.PartialCredentialsError,
                                exceptions.ProfileNotFound)):
            raise CredentialsRefused(
                f"DATA {self.store.location}: no usable AWS credentials ({error_summary(error)}); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE") from None
        elif isinstance(error, (exceptions.BotoCoreError, OSError)):
            reason = error_summary(error)
        else:
            return False
        raise StorageUnreachable(
            f"DATA {self.store.location}: reading {where} from {endpoint} failed after {self.store.attempts} "
            f"attempt(s): {reason}; once the store answers again, continue with --resume") from None


def _is_transient(error: BaseException) -> bool:
    """A body read cut short (a timeout, a reset connection), which the next attempt may get whole."""
    exceptions = _import_boto3("", "botocore.exceptions")
    return isinstance(error, (exceptions.ResponseStreamingError, exceptions.ReadTimeoutError,
                              exceptions.ConnectionClosedError, ConnectionError))


def _import_boto3(location: str, module: str = "boto3"):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"DATA {location}: reading an object store needs boto3: {S3_REQUIREMENT}") from None


CACHE_MARGIN_BYTES = 1 << 30  # no --data-cache-size: the cache fills its disk to this (or a twentieth of it, if less)
# A cached shard's file name (NodeCache.path: the first 24 hex digits of its sha256, then its name), or a copy's.
CACHED_NAME = re.compile(r"[0-9a-f]{24}-[^/]+\.tar(\.partial-[0-9]+)?")
COPY_CHUNK_BYTES = 8 << 20  # a shard is copied in pieces of this size: a 1 GB shard never sits in memory
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class DamagedShard(UsageError):
    """A shard whose bytes are not those its manifest names (size, sha256)."""

    rank_specific = True


class NodeCache(Store):
    """`source` (--data-cache DIR) behind a node-local copy of its shards.
    A shard's first read on a node copies all of it, under a lock file per
    shard (the node's other processes wait, then read the copy), checked
    against the manifest's size and sha256 and renamed into place when
    whole; later reads, by any process of the node, later epochs and
    requeued jobs, are local preads. Over `cap_bytes` the least recently
    opened shards are deleted; a shard that does not fit, or a full disk
    while copying, is a warning once per process and that shard is read
    from the source. Files are named by the shard's sha256, so datasets
    sharing a folder never mistake each other's shards."""

    def __init__(self, source: Store, directory: str, cap_bytes: int, expected: Mapping[str, Tuple[int, str]]):
        self.source, self.directory, self.cap_bytes = source, directory, cap_bytes
        self.expected = dict(expected)
        self.location = source.location
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            raise UsageError(f"argument --data-cache: {directory}: cannot create it ({error.strerror})") from None
        self._start_process()

    def _start_process(self):
        # This process's descriptors of cached shards (a forked worker's OpenFiles closes its parent's copies).
        self._files = getattr(self, "_files", None) or OpenFiles()
        self._uncached: set = set()  # shards this process reads from the source: the cache had no room
        self._warned, self._pid, self._lock = False, os.getpid(), threading.Lock()

    def __getstate__(self):
        return {key: self.__dict__[key] for key in ("source", "directory", "cap_bytes", "expected", "location")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._start_process()

    def describe(self) -> str:
        return f"{self.source.describe()}, cached in {self.directory}"

    def size(self, name: str) -> int:
        return self.source.size(name)

    def names(self) -> List[str]:
        return self.source.names()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{self.expected[name][1][:24]}-{name.replace('/', '_')}")

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> Fetched:
        if name not in self.expected:  # the manifest, an index: read once, not cached
            return self.source.read(name, offset, length)
        if self._pid != os.getpid():
            self._start_process()  # a forked worker: the parent's descriptors share its file offsets
        with self._lock:
            descriptor, copied_bytes = self._descriptor(name)
        if descriptor is None:
            fetched = self.source.read(name, offset, length)
            return Fetched(fetched.data, fetched.source_bytes + copied_bytes)
        if length is None:
            length = self.expected[name][0] - offset
        data = os.pread(descriptor, length, offset)
        return Fetched(data, source_bytes=copied_bytes, cache_bytes=len(data))

    def _descriptor(self, name: str) -> Tuple[Optional[int], int]:
        """This process's descriptor of the cached copy of `name` (None: read
        it from the source), and the bytes copied from the source to make it."""
        if name in self._uncached:
            return None, 0
        descriptor = self._files.get(name)
        if descriptor is not None:
            return descriptor, 0
        path = self.path(name)
        descriptor, copied_bytes = self._open_whole(name, path), 0
        if descriptor is None:
            with _locked(path + ".lock"):
                descriptor = self._open_whole(name, path)  # copied by another process while this one waited
                if descriptor is None:
                    copied_bytes, whole = self._copy(name, path)
                    descriptor = self._open_whole(name, path) if whole else None
        if descriptor is None:
            self._uncached.add(name)
        else:
            self._files.add(name, descriptor)
        return descriptor, copied_bytes

    def _open_whole(self, name: str, path: str) -> Optional[int]:
        """The cached copy, opened, if it is there and whole (its size: a cut copy is made again)."""
        descriptor = open_read_only(path, self.location, name)
        if descriptor is None:
            return None
        if os.fstat(descriptor).st_size != self.expected[name][0]:
            os.close(descriptor)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the eviction order: least recently opened first
        return descriptor

    def _copy(self, name: str, path: str) -> Tuple[int, bool]:
        """Copy shard `name` to `path` (this process holds its lock): the bytes
        read from the source, and whether the copy is in place."""
        size, sha256 = self.expected[name]
        for stale in glob.glob(glob.escape(path) + ".partial-*"):  # left by a killed process that held this lock
            _remove(stale)
        temporary, copied_bytes = f"{path}.partial-{os.getpid()}", 0
        try:
            with open(temporary, "wb") as copy:
                if not self._make_room(name, path, copy.fileno()):
                    return 0, False
                digest = hashlib.sha256()
                while copied_bytes < size:
                    chunk = self.source.read(name, copied_bytes, min(COPY_CHUNK_BYTES, size - copied_bytes)).data
                    if not chunk:
                        break
                    digest.update(chunk)
                    copied_bytes += len(chunk)
                    copy.write(chunk)
                copy.flush()
                os.fsync(copy.fileno())
            if copied_bytes != size or digest.hexdigest() != sha256:
                raise DamagedShard(f"DATA {self.source.location}: shard {name} is damaged: {copied_bytes} bytes with "
                                   f"sha256 {digest.hexdigest()[:16]}..., its manifest says {size} bytes with sha256 "
                                   f"{sha256[:16]}...; restore it or pack the data again")
            os.replace(temporary, path)
            return copied_bytes, True
        except OSError as error:
            if error.errno not in NO_ROOM:
                raise UsageError(f"argument --data-cache: cannot write {temporary} ({error.strerror})") from None
            self._warn(f"{error.strerror} while copying {name}")
            return copied_bytes, False
        finally:
            _remove(temporary)

    def _make_room(self, name: str, path: str, descriptor: int) -> bool:
        """Room for shard `name` (see make_room); False, with the warning, when it cannot fit."""
        size = self.expected[name][0]
        budget_bytes = make_room(self.directory, self.cap_bytes, path, size, descriptor)
        if budget_bytes is not None:
            self._warn(f"{name} ({format_bytes(size)}) does not fit in {format_bytes(budget_bytes)}")
        return budget_bytes is None

    def _warn(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"warning: --data-cache {self.directory}: cache full: reading on from the source ({reason})",
                  file=sys.stderr, flush=True)


def make_room(directory: str, cap_bytes: int, path: str, size: int, descriptor: int) -> Optional[int]:
    """Delete the least recently opened shards of the cache in `directory`
    until `size` more bytes (for `path`) fit under `cap_bytes` (0: its disk's
    free space, less a margin), and reserve them (fallocate `descriptor`,
    under the cache's lock: copies made at once by several processes all
    count). None when done; the cache's budget when `size` cannot fit."""
    with _locked(os.path.join(directory, ".room.lock")):
        cached, busy_bytes = [], 0
        for entry in os.scandir(directory):
            # The cache's own files only (NodeCache.path's names): DIR may hold anything else, never deleted.
            if entry.path == path or not CACHED_NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                status = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # renamed into place or removed by another process since the listing
                continue
            if ".partial-" in entry.name:
                if not _alive(int(entry.name.rsplit("-", 1)[1])):  # left by a killed process: its room is free
                    _remove(entry.path)
                    continue
                busy_bytes += status.st_size  # another shard's copy, its space reserved
            else:
                cached.append((status.st_mtime, status.st_size, entry.path))
        used_bytes = busy_bytes + sum(bytes_ for _, bytes_, _ in cached)
        budget_bytes = cap_bytes
        if not cap_bytes:
            free_bytes, _ = room_at(directory)
            disk = os.statvfs(directory)
            budget_bytes = used_bytes + free_bytes - min(CACHE_MARGIN_BYTES, disk.f_blocks * disk.f_frsize // 20)
        if busy_bytes + size > budget_bytes:
            return budget_bytes
        for _, bytes_, oldest in sorted(cached):
            if used_bytes + size <= budget_bytes:
                break
            _remove(oldest)
            used_bytes -= bytes_
        with contextlib.suppress(OSError):  # a file system without fallocate: the copy's writes say it
            os.posix_fallocate(descriptor, 0, size)
        return None


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on the file `path` (made if missing), held by this process until the block ends."""
    try:
        handle = open(path, "a")
    except OSError as error:
        raise UsageError(f"argument --data-cache: cannot write {path} ({error.strerror})") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (on this node: the cache is node-local; another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def open_store(location: str, endpoint_url: Optional[str] = None) -> Store:
    """The store at `location`: a directory, or s3://bucket/prefix (the
    endpoint from `endpoint_url`, else the AWS environment or profile)."""
    if is_object_store(location):
        return S3Store(location, endpoint_url)
    return LocalStore(location)


def with_cache(source: Store, directory: Optional[str], cap_bytes: int,
               expected: Mapping[str, Tuple[int, str]]) -> Store:
    """`source` behind the node-local cache in `directory` (--data-cache),
    holding at most `cap_bytes` (0: as much as its disk has free, less a
    margin); `expected`: each shard's (size, sha256) from the manifest,
    checked when a shard is copied in. `source` itself when `directory` is None."""
    if directory is None:
        return source
    return NodeCache(source, directory, cap_bytes, expected)

"""common.storage: the node-local cache (NodeCache) over a LocalStore in a
temporary folder, and S3Store against a real S3 server on loopback (moto's
server mode, tests/s3_server.py): exact byte counts of where every read came
from, and each failure as one line with its exit status."""
from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import pickle
import sys
import time

import pytest

from common import errors, storage
from common.storage import Fetched, LocalStore, NodeCache, S3Store
from s3_server import BUCKET, TEST_KEY_ID, TEST_SECRET, S3Server, moto_missing, serving, use_credentials

SHARD_BYTES = 3 * storage.COPY_CHUNK_BYTES // 2 + 17  # two copy pieces, the second one short


def make_shards(folder, count: int = 3, size: int = SHARD_BYTES):
    """Shards shard-<i>.tar of `size` distinct bytes each; their manifest entries {name: (size, sha256)}."""
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for index in range(count):
        data = hashlib.shake_128(bytes([index])).digest(size)
        (folder / f"shard-{index}.tar").write_bytes(data)
        expected[f"shard-{index}.tar"] = (size, hashlib.sha256(data).hexdigest())
    return expected


def shard(folder, index: int) -> bytes:
    return (folder / f"shard-{index}.tar").read_bytes()


def cached_files(cache_dir):
    return sorted(name for name in os.listdir(cache_dir) if not name.endswith(".lock"))


def test_a_shard_is_copied_once_then_read_from_the_cache_also_by_a_requeued_job(tmp_path):
    expected = make_shards(tmp_path / "data")
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 0, expected)
    first = cache.read("shard-1.tar", 1000, 100)
    assert first == Fetched(shard(tmp_path / "data", 1)[1000:1100], source_bytes=SHARD_BYTES, cache_bytes=100)
    assert cache.read("shard-1.tar", 5, 7) == Fetched(shard(tmp_path / "data", 1)[5:12], 0, 7)
    assert cache.read("shard-1.tar", SHARD_BYTES - 3) == Fetched(shard(tmp_path / "data", 1)[-3:], 0, 3)
    assert cached_files(tmp_path / "cache") == [f"{expected['shard-1.tar'][1][:24]}-shard-1.tar"]
    # Another process (a data-loading worker, the next epoch's, a requeued job's) finds the copy whole.
    again = pickle.loads(pickle.dumps(cache))
    assert again.read("shard-1.tar", 0, 10) == Fetched(shard(tmp_path / "data", 1)[:10], 0, 10)
    # What the manifest does not name (the manifest itself) is read from the source, never kept.
    (tmp_path / "data" / "manifest.json").write_text("{}")
    assert cache.read("manifest.json") == Fetched(b"{}", 2, 0)
    assert "cached in" in cache.describe() and len(cached_files(tmp_path / "cache")) == 1


def _racing_read(cache, barrier, results, index):
    barrier.wait()
    fetched = cache.read("shard-0.tar", index * 10, 10)
    results.put((index, fetched.data, fetched.source_bytes, fetched.cache_bytes))


def test_processes_racing_for_one_shard_copy_it_once(tmp_path):
    expected = make_shards(tmp_path / "data", count=1)
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 0, expected)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3), context.Queue()
    racers = [context.Process(target=_racing_read, args=(cache, barrier, results, index)) for index in range(3)]
    for racer in racers:
        racer.start()
    got = sorted(results.get(timeout=120) for _ in racers)
    for racer in racers:
        racer.join(timeout=120)
    data = shard(tmp_path / "data", 0)
    assert [(index, payload) for index, payload, _, _ in got] == [(index, data[index * 10:index * 10 + 10])
                                                                   for index in range(3)]
    assert sum(source for _, _, source, _ in got) == SHARD_BYTES  # one copy among the three
    assert [cache_bytes for _, _, _, cache_bytes in got] == [10, 10, 10]
    assert len(cached_files(tmp_path / "cache")) == 1  # no partial copy left


def test_over_its_cap_the_cache_deletes_the_least_recently_opened_shards(tmp_path):
    expected = make_shards(tmp_path / "data", size=1000)
    source = LocalStore(str(tmp_path / "data"))
    cache = NodeCache(source, str(tmp_path / "cache"), 2500, expected)
    assert [cache.read(f"shard-{index}.tar", 0, 1).source_bytes for index in (0, 1)] == [1000, 1000]
    os.utime(cache.path("shard-0.tar"), (1, 1))  # opened long ago: the first to go
    assert cache.read("shard-2.tar", 0, 1) == Fetched(shard(tmp_path / "data", 2)[:1], 1000, 1)
    assert cached_files(tmp_path / "cache") == sorted(os.path.basename(cache.path(f"shard-{index}.tar"))
                                                      for index in (1, 2))
    # This process keeps reading shard 0 from its open copy; a new one copies it again.
    assert cache.read("shard-0.tar", 1, 2) == Fetched(shard(tmp_path / "data", 0)[1:3], 0, 2)
    assert NodeCache(source, str(tmp_path / "cache"), 2500, expected).read("shard-0.tar", 0, 1).source_bytes == 1000


def test_the_cache_evicts_its_own_shards_only_never_the_users_files(tmp_path):
    """--data-cache /scratch/$USER: what else the folder holds (older files, folders) is never deleted."""
    expected = make_shards(tmp_path / "data", size=1000)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "thesis.tex").write_text("the user's")
    (tmp_path / "cache" / "results").mkdir()
    for old in ("thesis.tex", "results"):
        os.utime(tmp_path / "cache" / old, (1, 1))  # older than any shard: the first to go, were they the cache's
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 2500, expected)
    assert [cache.read(f"shard-{index}.tar", 0, 1).source_bytes for index in range(3)] == [1000] * 3
    assert (tmp_path / "cache" / "thesis.tex").read_text() == "the user's" and (tmp_path / "cache" / "results").is_dir()
    assert len([name for name in cached_files(tmp_path / "cache") if name.endswith(".tar")]) == 2  # under the cap
    # A copy left by a killed process (no such pid) holds no room: a shard that fits beside the others is copied.
    dead = cache.path("shard-1.tar") + ".partial-999999999"  # another shard's: not its own stale copy
    with open(dead, "wb") as left:
        left.truncate(2000)
    assert NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 2500, expected).read(
        "shard-0.tar", 0, 1).source_bytes == 1000
    assert not os.path.exists(dead)


def test_a_process_keeps_at_most_its_limit_of_shards_open(tmp_path):
    """ImageNet in 100 MB shards is ~1,500 files, over the usual 1,024 descriptors a process: the least
    recently read are closed, and read again they are opened again; a store let go closes its own."""
    expected = make_shards(tmp_path / "data", count=8, size=100)
    folder = str(tmp_path / "data")

    def open_here():
        return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(folder) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    store = LocalStore(folder)
    store._files.limit = 3
    for _ in range(2):
        assert [store.read(f"shard-{index}.tar", 5, 4).data for index in range(8)] == [
            shard(tmp_path / "data", index)[5:9] for index in range(8)]
        assert open_here() == 3
    cache = NodeCache(LocalStore(folder), str(tmp_path / "cache"), 0, expected)
    cache._files.limit = 2
    assert [cache.read(f"shard-{index}.tar", 0, 2).cache_bytes for index in range(8)] == [2] * 8
    del store, cache
    assert open_here() == 0


def test_a_shard_above_the_cap_is_read_from_the_source_with_one_warning(tmp_path, capfd):
    expected = make_shards(tmp_path / "data", size=1000)
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 999, expected)
    reads = [cache.read(f"shard-{index}.tar", 10, 5) for index in (0, 1, 0)]
    assert reads == [Fetched(shard(tmp_path / "data", index)[10:15], 5, 0) for index in (0, 1, 0)]
    warnings = capfd.readouterr().err.splitlines()
    assert warnings == [f"warning: --data-cache {tmp_path / 'cache'}: cache full: reading on from the source "
                        "(shard-0.tar (1.0 KB) does not fit in 999 B)"]
    assert cached_files(tmp_path / "cache") == []


def test_a_full_disk_while_copying_is_a_warning_and_the_read_goes_on_from_the_source(tmp_path, capfd, monkeypatch):
    expected = make_shards(tmp_path / "data", count=1)
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 0, expected)

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)  # where a network or quota'd file system says it: at the flush
    first = cache.read("shard-0.tar", 3, 4)
    assert first == Fetched(shard(tmp_path / "data", 0)[3:7], SHARD_BYTES + 4, 0)  # the partial copy counted too
    assert cache.read("shard-0.tar", 3, 4) == Fetched(shard(tmp_path / "data", 0)[3:7], 4, 0)
    assert capfd.readouterr().err.count("cache full: reading on from the source (No space left on device") == 1
    assert cached_files(tmp_path / "cache") == []


def test_a_damaged_source_shard_is_one_line_and_leaves_no_copy(tmp_path):
    expected = make_shards(tmp_path / "data", count=1)
    damaged = bytearray(shard(tmp_path / "data", 0))
    damaged[12345] ^= 1
    (tmp_path / "data" / "shard-0.tar").write_bytes(bytes(damaged))
    cache = NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 0, expected)
    with pytest.raises(storage.DamagedShard) as raised:
        cache.read("shard-0.tar", 0, 10)
    message = str(raised.value)
    assert message.startswith(f"DATA {tmp_path / 'data'}: shard shard-0.tar is damaged: {SHARD_BYTES} bytes with "
                              f"sha256 {hashlib.sha256(bytes(damaged)).hexdigest()[:16]}..., its manifest says")
    assert "\n" not in message and raised.value.status == errors.USAGE_EXIT_STATUS == 2
    assert cached_files(tmp_path / "cache") == []
    (tmp_path / "data" / "shard-0.tar").write_bytes(bytes(damaged[:100]))  # cut short: the same line
    with pytest.raises(storage.DamagedShard, match="shard shard-0.tar is damaged: 100 bytes"):
        NodeCache(LocalStore(str(tmp_path / "data")), str(tmp_path / "cache"), 0, expected).read("shard-0.tar", 0, 1)


def test_a_cut_short_cached_copy_is_copied_again(tmp_path):
    expected = make_shards(tmp_path / "data", count=1)
    source = LocalStore(str(tmp_path / "data"))
    cache = NodeCache(source, str(tmp_path / "cache"), 0, expected)
    cache.read("shard-0.tar", 0, 1)
    os.truncate(cache.path("shard-0.tar"), 1000)  # a copy a crash or a full disk cut short, outside this code
    open(cache.path("shard-0.tar") + ".partial-999999", "wb").close()  # a killed copier's leftover
    again = NodeCache(source, str(tmp_path / "cache"), 0, expected)
    assert again.read("shard-0.tar", 2000, 3) == Fetched(shard(tmp_path / "data", 0)[2000:2003], SHARD_BYTES, 3)
    assert os.path.getsize(cache.path("shard-0.tar")) == SHARD_BYTES
    assert cached_files(tmp_path / "cache") == [os.path.basename(cache.path("shard-0.tar"))]


# --- S3Store, against a real S3 server on loopback ---

s3 = pytest.mark.skipif(bool(moto_missing()), reason=moto_missing() or "moto is installed")
OBJECTS = {"imagenet-shards/shard-0.tar": hashlib.shake_128(b"0").digest(70_000),
           "imagenet-shards/manifest.json": b'{"format": "test"}', "elsewhere/other.tar": b"not under the prefix"}
LOCATION = f"s3://{BUCKET}/imagenet-shards"


@pytest.fixture(scope="module")
def s3_server():
    with serving(OBJECTS) as server:
        yield server


@s3
def test_s3_reads_byte_ranges_sizes_and_names_from_a_real_server(s3_server):
    store = S3Store(LOCATION, s3_server.endpoint_url)
    data = OBJECTS["imagenet-shards/shard-0.tar"]
    assert store.names() == ["manifest.json", "shard-0.tar"]
    assert store.size("shard-0.tar") == 70_000
    assert store.read("shard-0.tar", 65_000, 4321) == Fetched(data[65_000:69_321], 4321, 0)
    assert store.read("shard-0.tar", 69_990) == Fetched(data[69_990:], 10, 0)
    assert store.read("manifest.json") == Fetched(b'{"format": "test"}', 18, 0)
    # Pickled into a data-loading worker: no client, no credentials; its own client there.
    pickled = pickle.dumps(store)
    assert TEST_SECRET.encode() not in pickled and TEST_KEY_ID.encode() not in pickled
    assert pickle.loads(pickled).read("shard-0.tar", 1, 2).data == data[1:3]
    assert store.describe() == f"{LOCATION} at {s3_server.endpoint_url}"


@s3
def test_s3_behind_the_node_cache_copies_a_shard_once(s3_server, tmp_path):
    data = OBJECTS["imagenet-shards/shard-0.tar"]
    expected = {"shard-0.tar": (len(data), hashlib.sha256(data).hexdigest())}
    cache = storage.with_cache(storage.open_store(LOCATION, s3_server.endpoint_url), str(tmp_path), 0, expected)
    assert [cache.read("shard-0.tar", 100, 50) for _ in range(2)] == [Fetched(data[100:150], 70_000, 50),
                                                                       Fetched(data[100:150], 0, 50)]


@s3
def test_s3_missing_objects_are_one_line_naming_them(s3_server):
    store = S3Store(LOCATION, s3_server.endpoint_url)
    for action in (lambda: store.read("shard-9.tar", 0, 10), lambda: store.size("shard-9.tar")):
        with pytest.raises(storage.MissingObject) as raised:
            action()
        assert str(raised.value).startswith(f"DATA {LOCATION}: {LOCATION}/shard-9.tar is missing (")
        assert raised.value.status == 2
    with pytest.raises(storage.MissingObject, match="s3://no-such-bucket/x/shard-0.tar is missing \\(NoSuchBucket"):
        S3Store("s3://no-such-bucket/x", s3_server.endpoint_url).read("shard-0.tar", 0, 1)


@s3
@pytest.mark.parametrize("wrong", ["key", "secret"])
def test_s3_refused_credentials_are_one_line_without_the_secret(s3_server, monkeypatch, wrong):
    key_id, secret = s3_server.iam_user(f"trainer-{wrong}")
    s3_server.check_credentials(True)
    try:
        use_credentials(monkeypatch, key_id, secret)
        assert S3Store(LOCATION, s3_server.endpoint_url).read("shard-0.tar", 0, 3).source_bytes == 3
        wrong_pair = ("AKIAWRONGWRONGWRONG0", secret) if wrong == "key" else (key_id, "wrong-s3cret")
        use_credentials(monkeypatch, *wrong_pair)
        with pytest.raises(storage.CredentialsRefused) as raised:
            S3Store(LOCATION, s3_server.endpoint_url).read("shard-0.tar", 0, 3)
        with pytest.raises(storage.CredentialsRefused, match=r"refused the credentials reading .*shard-0.tar \(403\)"):
            S3Store(LOCATION, s3_server.endpoint_url).size("shard-0.tar")  # a HEAD's answer: its status alone
    finally:
        s3_server.check_credentials(False)
    code = {"key": "InvalidAccessKeyId", "secret": "SignatureDoesNotMatch"}[wrong]
    assert str(raised.value) == (f"DATA {LOCATION}: {s3_server.endpoint_url} refused the credentials reading "
                                 f"{LOCATION}/shard-0.tar ({code}); check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                                 "AWS_PROFILE and the bucket's permissions")
    assert raised.value.status == 2 and secret not in str(raised.value)


@s3
def test_a_stopped_s3_server_is_retried_then_one_line_with_status_5(s3_server, tmp_path):
    server = S3Server()  # its own: this test stops it
    try:
        server.upload({"imagenet-shards/shard-0.tar": b"x" * 100})
        store = S3Store(LOCATION, server.endpoint_url, attempts=4, connect_timeout_s=5, read_timeout_s=5)
        attempts = []
        store.read("shard-0.tar", 0, 10)
        store._s3().meta.events.register("before-send.s3.*", lambda **_: attempts.append(1))
    finally:
        server.stop()
    started = time.monotonic()
    with pytest.raises(storage.StorageUnreachable) as raised:
        store.read("shard-0.tar", 10, 10)
    took_s = time.monotonic() - started
    assert str(raised.value).startswith(f"DATA {LOCATION}: reading {LOCATION}/shard-0.tar from {server.endpoint_url} "
                                        "failed after 4 attempt(s): Could not connect to the endpoint URL")
    assert str(raised.value).endswith("once the store answers again, continue with --resume")
    assert raised.value.status == errors.DATA_TIMEOUT_EXIT_STATUS == 5 and len(attempts) == 4
    # botocore's back-off is 0.05 s doubling with jitter (0.35 s at most over 3 retries), and a refused connect
    # is at once; the bound only says the read ends, whatever the machine's load.
    assert took_s < 4 * 5


@s3
def test_an_error_in_a_data_loading_worker_reaches_the_user_as_its_one_line(s3_server):
    torch_data = pytest.importorskip("torch.utils.data")

    class Shards(torch_data.Dataset):
        def __init__(self, store):
            self.store = store

        def __len__(self):
            return 1

        def __getitem__(self, index):
            return self.store.read("shard-404.tar", 0, 1).data

    loader = torch_data.DataLoader(Shards(S3Store(LOCATION, s3_server.endpoint_url)), num_workers=1,
                                   multiprocessing_context="fork")
    with pytest.raises(storage.MissingObject) as raised:
        next(iter(loader))
    assert str(raised.value) == (f"DATA {LOCATION}: {LOCATION}/shard-404.tar is missing "
                                 f"(NoSuchKey from {s3_server.endpoint_url})")


def test_credentials_in_urls_are_refused_and_never_repeated():
    with pytest.raises(errors.UsageError) as raised:
        S3Store("s3://bucket/x", "http://alice:s3cret@127.0.0.1:9000")
    assert str(raised.value) == ("argument --s3-endpoint-url: http://***@127.0.0.1:9000: credentials in the URL are "
                                 "refused; give them as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or an AWS profile")
    for url in ("s3://AKIA:s3cret@bucket/x", "s3://AKIA:s3/cret@bucket/x"):  # a secret may hold '/' (base64)
        with pytest.raises(errors.UsageError, match=r"^DATA: an s3:// URL with '@' in it \(credentials\?\) is refused") \
                as raised:
            S3Store(url)
        assert "cret" not in str(raised.value)
    with pytest.raises(errors.UsageError, match="^argument --s3-endpoint-url: 'ftp://host' is no http"):
        S3Store("s3://bucket/x", "ftp://host")


def test_without_boto3_an_s3_location_names_the_requirements_file(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    with pytest.raises(errors.UsageError) as raised:
        storage.open_store("s3://bucket/prefix")
    assert str(raised.value) == ("DATA s3://bucket/prefix: reading an object store needs boto3: "
                                 "pip install -r requirements-s3.txt")
    assert isinstance(storage.open_store("/data/shards"), LocalStore)

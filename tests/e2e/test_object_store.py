"""Shards in an S3 object store, read through a real S3 server on loopback
(moto's server mode, tests/s3_server.py) and the node-local cache, by
data-loading workers as training reads them: each shard copied once per
node, exact byte counts of where reads came from, and a server stopped
mid-epoch as one line. The training runs through s3:// and --data-cache need
common.shards (the packing tool and the sharded dataset): they are skipped,
with the reason, where it is missing."""
from __future__ import annotations

import hashlib
import importlib.util
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from common import errors, storage
from helpers import REPO, FAST_ARGS, csv_rows, max_abs_diff, metrics_rows, run_script, single_run_dir, weights
from s3_server import BUCKET, REGION, TEST_KEY_ID, TEST_SECRET, S3Server, moto_missing, serving, use_credentials

pytestmark = pytest.mark.skipif(bool(moto_missing()), reason=moto_missing() or "moto is installed")

PREFIX = "shards"
LOCATION = f"s3://{BUCKET}/{PREFIX}"
SHARD_BYTES = 50_000
SHARDS = {f"train-{index:06d}.tar": hashlib.shake_128(bytes([index])).digest(SHARD_BYTES) for index in range(3)}
EXPECTED = {name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in SHARDS.items()}
# Samples: (shard, offset, length), 8 from each shard, in an order that mixes them as a permutation does.
SAMPLES = [(name, 1000 * index + 7, 500 + index) for index in range(8) for name in sorted(SHARDS)][::-1]


@pytest.fixture(scope="module")
def s3_server():
    with serving({f"{PREFIX}/{name}": data for name, data in SHARDS.items()}) as server:
        yield server


class ShardRanges(Dataset):
    """What a sharded split's read does for each sample: a byte range of a shard, through a store."""

    def __init__(self, store: storage.Store):
        self.store = store

    def __len__(self):
        return len(SAMPLES)

    def __getitem__(self, index):
        name, offset, length = SAMPLES[index]
        fetched = self.store.read(name, offset, length)
        return index, torch.frombuffer(bytearray(fetched.data), dtype=torch.uint8), fetched.source_bytes, \
            fetched.cache_bytes


def read_epoch(store: storage.Store, workers: int, batch_size: int = 1):
    """Every sample once, by `workers` forked data-loading processes: [(index, data, source, cache)]."""
    loader = DataLoader(ShardRanges(store), batch_size=batch_size, num_workers=workers,
                        multiprocessing_context="fork" if workers else None, collate_fn=lambda batch: batch)
    return [sample for batch in loader for sample in batch]


def test_data_loading_workers_copy_each_shard_once_per_node_then_read_the_cache(s3_server, tmp_path):
    store = storage.with_cache(storage.open_store(LOCATION, s3_server.endpoint_url), str(tmp_path / "cache"), 0,
                               EXPECTED)
    first = read_epoch(store, workers=2)
    for index, data, _, _ in first:
        name, offset, length = SAMPLES[index]
        assert bytes(data.numpy()) == SHARDS[name][offset:offset + length]
    # Both processes met each shard; one of them copied it (its lock held the other), both read the copy.
    assert sum(source for *_, source, _ in first) == 3 * SHARD_BYTES
    assert sum(cache for *_, cache in first) == sum(length for _, _, length in SAMPLES)
    # The next epoch's workers (and a requeued job's) find every shard whole: nothing from the store.
    second = read_epoch(store, workers=2)
    assert sum(source for *_, source, _ in second) == 0
    assert sorted(index for index, *_ in second) == list(range(len(SAMPLES)))


def test_a_server_stopped_mid_epoch_ends_the_reading_with_one_line(tmp_path):
    server = S3Server()  # its own, stopped below
    try:
        with pytest.MonkeyPatch.context() as environment:
            use_credentials(environment)
            server.upload({f"{PREFIX}/{name}": data for name, data in SHARDS.items()})
            store = storage.S3Store(LOCATION, server.endpoint_url, attempts=3, connect_timeout_s=5, read_timeout_s=5)
            batches = iter(DataLoader(ShardRanges(store), batch_size=2, num_workers=1, multiprocessing_context="fork",
                                      collate_fn=lambda batch: batch))
            read = [next(batches)]
            server.stop()
            started = time.monotonic()
            with pytest.raises(storage.StorageUnreachable) as raised:
                read.extend(batches)
    finally:
        server.stop()
    # The worker had read ahead (prefetch_factor 2) before the stop; then one line, from the worker's error.
    assert 1 <= len(read) <= 3
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message and raised.value.status == 5
    assert message.startswith(f"DATA {LOCATION}: reading {LOCATION}/train-0000")
    assert f"from {server.endpoint_url} failed after 3 attempt(s): Could not connect to the endpoint URL" in message
    assert time.monotonic() - started < 60  # retried, not for ever (about a second here)


# --- training through s3:// (needs common.shards) ---

def needs_shards():
    if importlib.util.find_spec("common.shards") is None:
        pytest.skip("common.shards (the sharded dataset and common.tools.pack_shards) is not in this tree")


@pytest.fixture(scope="module")
def packed(tmp_path_factory, s3_server):
    """The digits-sized tree, packed into shards and uploaded under s3://imagenet/packed."""
    needs_shards()
    from helpers import make_image_folder

    root = tmp_path_factory.mktemp("packed")
    tree = make_image_folder(root / "tree")
    result = run_script(["-m", "common.tools.pack_shards", tree, root / "shards"])
    assert result.returncode == 0, result.stderr
    s3_server.upload({f"packed/{path.name}": path.read_bytes() for path in (root / "shards").iterdir()})
    return tree, root / "shards"


def train(data, logdir: Path, server: S3Server, *extra, epochs: int = 2, key_id=TEST_KEY_ID, secret=TEST_SECRET):
    """imagenet_nd.py for `epochs` epochs, in a fresh process with these credentials (the rest of the AWS
    environment is the module fixture's: no profile, no ~/.aws)."""
    environment = {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": REGION}
    endpoint = ["--s3-endpoint-url", server.endpoint_url] if str(data).startswith("s3://") else []  # s3:// only
    return run_script([REPO / "imagenet_nd.py", data, *FAST_ARGS, "--epochs", str(epochs), "--logdir", logdir,
                       *endpoint, *extra], env_extra=environment)


@pytest.mark.slow
def test_training_from_s3_through_the_cache_resumes_on_the_folder_trees_weights(packed, s3_server, tmp_path):
    """Epoch 0 from s3:// through --data-cache, then a requeued job (a new process, --resume auto) trains
    epoch 1 from the cache the first one filled: it pulls nothing from the store, and ends on the weights
    of the uninterrupted run on the folder tree."""
    tree, shards = packed
    folder = train(tree, tmp_path / "folder", s3_server)
    s3_job = [f"s3://{BUCKET}/packed", tmp_path / "s3", s3_server, "--data-cache", tmp_path / "cache",
              "--run-name", "from-s3", "--resume", "auto"]
    first, requeued = train(*s3_job, epochs=1), None
    assert first.returncode == 0, first.stderr
    requeued = train(*s3_job)
    assert folder.returncode == 0 and requeued.returncode == 0, (folder.stderr, requeued.stderr)
    folder_run, s3_run = single_run_dir(tmp_path / "folder"), tmp_path / "s3" / "from-s3"
    assert max_abs_diff(weights(folder_run / "checkpoint.pth.tar"), weights(s3_run / "checkpoint.pth.tar")) == 0
    rows = {(row["epoch"], row["split"]): row for row in metrics_rows(s3_run)}
    train_shards = sum(path.stat().st_size for path in shards.glob("train-*.tar"))
    assert int(rows[("0", "train")]["source_bytes"]) == train_shards  # each shard copied once, on its first read
    assert int(rows[("1", "train")]["source_bytes"]) == 0  # the requeued job: all from the cache
    assert int(rows[("1", "train")]["cache_bytes"]) == int(rows[("1", "train")]["dataset_bytes"])
    data_rows = [row for row in csv_rows(s3_run / "io.csv") if row["kind"] == "data"]
    assert [(row["epoch"], row["split"]) for row in data_rows] == [("0", "train"), ("0", "val"), ("1", "train"),
                                                                   ("1", "val")]
    assert "pulled from the source" in first.stdout and "from the source" not in folder.stdout


@pytest.mark.slow
def test_refused_credentials_end_the_run_with_one_line(packed, s3_server, tmp_path):
    key_id, secret = s3_server.iam_user("e2e-trainer")
    s3_server.check_credentials(True)
    try:
        result = train(f"s3://{BUCKET}/packed", tmp_path / "refused", s3_server, key_id=key_id, secret="wrong-secret")
    finally:
        s3_server.check_credentials(False)
    assert result.returncode == errors.USAGE_EXIT_STATUS, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refused the credentials" in lines[0] and "SignatureDoesNotMatch" in lines[0]
    assert "wrong-secret" not in result.stderr + result.stdout

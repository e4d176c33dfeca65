"""The places the storage section reads from, set up and taken down: the
JPEG tree packed into shards (python -m common.tools.pack_shards), an S3
server on loopback (moto's server mode) holding those shards, and a
throttled copy of both (throttled_storage). Each returns what it made, or
why it could not ('not measured: ...'), so the section's rows say it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

from common.ports import free_port
from common.tools.bench import throttled_storage

REPO = Path(__file__).resolve().parents[3]
SHARD_BYTES = 16 * 2**20  # shards of the section's small tree: several, so the reader moves between them
BUCKET = "bench-storage"
# moto's server takes any key pair; these are its documented test credentials, never real ones.
MOTO_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}
SERVER_START_SECONDS = 60.0


def pack(tree: str, out: Path) -> str:
    """`tree` packed into shards at `out` (once: a finished pack is reused);
    '' when done, else why not, in one line."""
    if (out / "manifest.json").is_file():
        return ""
    if not (REPO / "common" / "tools" / "pack_shards.py").is_file():
        return "not measured: python -m common.tools.pack_shards is not in this checkout"
    done = subprocess.run([sys.executable, "-m", "common.tools.pack_shards", tree, str(out), "--shard-size",
                           str(SHARD_BYTES)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        last = (done.stdout.strip().splitlines() or ["no output"])[-1]
        return f"not measured: pack_shards failed (exit {done.returncode}): {last[:300]}"
    return ""


class ObjectStore(NamedTuple):
    data: str  # s3://bucket/prefix, for DATA
    endpoint_url: str
    problem: str  # '' when it serves; else why not


def _wait_for_port(port: int, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        time.sleep(0.1)  # polling a server's port: nothing to wait on instead
    return False


@contextlib.contextmanager
def object_store(shards: Path) -> Iterator[ObjectStore]:
    """moto's S3 server on a free loopback port, `shards` uploaded into it;
    stopped on leaving. Its objects live in the server's memory."""
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    try:
        import boto3
    except ImportError:
        boto3 = None
    if server is None or boto3 is None:
        yield ObjectStore("", "", "not measured: needs boto3 and moto[server] (pip install -r requirements-s3.txt)")
        return
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, **MOTO_ENVIRONMENT})
    try:
        if not _wait_for_port(port, process):
            yield ObjectStore("", "", f"not measured: moto_server did not serve {endpoint} within "
                                      f"{SERVER_START_SECONDS:.0f} s")
            return
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=MOTO_ENVIRONMENT["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=MOTO_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
                              region_name=MOTO_ENVIRONMENT["AWS_DEFAULT_REGION"])
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(shards.iterdir()):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"shards/{path.name}")
        yield ObjectStore(f"s3://{BUCKET}/shards", endpoint, "")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in Path(root).rglob("*") if path.is_file())


@contextlib.contextmanager
def throttled_copy(folder: Path, read_iops: int, read_bytes_per_second: int,
                   *sources: Optional[Path]) -> Iterator[Optional[throttled_storage.ThrottledStorage]]:
    """A throttled file system holding a copy of each of `sources` (by its
    name); None where one cannot be set up here (throttled_storage.unavailable)."""
    if throttled_storage.unavailable():
        yield None
        return
    present = [Path(source) for source in sources if source is not None and Path(source).exists()]
    size = 2 * sum(tree_bytes(source) for source in present) + 128 * 2**20  # ext4's own room, with slack
    with throttled_storage.ThrottledStorage(folder, size, read_iops, read_bytes_per_second) as storage:
        for source in present:
            shutil.copytree(source, storage.mount_point / source.name)
        yield storage

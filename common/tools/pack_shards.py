"""Pack a dataset folder into tar shards a training run reads by random access.

    python -m common.tools.pack_shards DATA OUT [--shard-size 256M] [--max-side PX] [--jpeg-quality Q]
        DATA/train/<class>/<image> and DATA/val/<class>/<image>, scanned as a
        training run scans them (same classes, same order), become
        OUT/train-NNNNNN.tar, OUT/val-NNNNNN.tar (WebDataset's layout: KEY.jpg
        and KEY.cls per image), OUT/train-index.npz, OUT/val-index.npz and,
        last, OUT/manifest.json. Train with imagenet_nd.py OUT.
    python -m common.tools.pack_shards --verify OUT
        reads every shard and index whole and checks its size and sha256
        against the manifest; names each damaged or missing one (exit 2).

The images are assigned to shards before any is written (by count, from the
mean file size and --shard-size; training images in a --seed shuffled
order), so an interrupted pack run again with the same options keeps every
shard it finished (its size and sha256 checked against the record kept in
OUT/.pack/) and writes only the rest; the result is byte for byte the
uninterrupted pack's. An OUT holding anything else is refused, never
overwritten. --max-side and --jpeg-quality re-encode each image as a JPEG
(smaller files, as FFCV stores them; recorded in the manifest); an image
Pillow cannot read is stored as it is, for --bad-images to decide about in
training.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from PIL import Image

from common.arguments import Parser, byte_size, int_at_least
from common.dataset_lists import SPLITS, DatasetLists, FileList, pack, scan_dataset
from common.errors import UsageError, error_summary, run_main
from common.files import atomic_write, format_bytes
from common.shards import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, expected_shards, index_name, open_sharded,
                           shard_name, stored_sha256, verify)
from common.storage import LocalStore

TOOL_VERSION = 1
DEFAULT_SHARD_SIZE = "256M"  # bytes, decimal: within the 100-1,000 MB that object stores and readers stream well
TAR_HEADER_BYTES = 2 * tarfile.BLOCKSIZE  # a member's header, and its padding on average (with the .cls member's)
WORK_FOLDER = ".pack"  # the record of an unfinished pack: its options and each finished shard's checksums
DEFAULT_JPEG_QUALITY = 90


def build_parser() -> Parser:
    parser = Parser(prog="python -m common.tools.pack_shards", description=__doc__.split("\n\n")[0])
    # A string: Path would fold s3://bucket into s3:/bucket (--fill-cache); pack_dataset makes it a Path.
    parser.add_argument("data", metavar="DATA", help="the dataset folder, holding train/ and val/ (with --verify: the "
                                                     "shards' folder; with --fill-cache: it, or s3://bucket/prefix)")
    parser.add_argument("out", type=Path, metavar="OUT", nargs="?", help="the shards' folder (new, or an "
                                                                        "interrupted pack's, to finish it)")
    parser.add_argument("--shard-size", type=byte_size, default=byte_size(DEFAULT_SHARD_SIZE), metavar="SIZE",
                        help=f"bytes per shard, about (200M, 1G, 512MiB; default {DEFAULT_SHARD_SIZE})")
    parser.add_argument("--max-side", type=int_at_least(16, "a side of 16 pixels or more"), default=None,
                        metavar="PX", help="re-encode each image as a JPEG no longer than PX on its longer side")
    parser.add_argument("--jpeg-quality", type=int_at_least(1, "a JPEG quality from 1 to 100", 100), default=None,
                        metavar="Q", help=f"re-encode each image as a JPEG of quality Q (with --max-side: "
                                          f"{DEFAULT_JPEG_QUALITY} unless given)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of the training images inside the shards")
    parser.add_argument("--verify", action="store_true", help="check the shards in DATA against their manifest")
    parser.add_argument("--fill-cache", metavar="DIR", default=None,
                        help="copy every shard of DATA into the node-local cache DIR (what --data-cache DIR does in "
                             "a first epoch), checked against the manifest: once per node before training, so the "
                             "first epoch reads locally instead of waiting for copies")
    parser.add_argument("--s3-endpoint-url", default=None, metavar="URL",
                        help="with --fill-cache and s3:// DATA: the S3-compatible server (default: the AWS "
                             "environment's or profile's)")
    return parser


def fill_cache(data: str, directory: str, endpoint_url: Optional[str]) -> None:
    """--fill-cache: each shard of `data` copied into the cache `directory`
    (skipped when already there and whole), one progress line each."""
    dataset = open_sharded(data, directory, 0, endpoint_url)
    names = list(expected_shards(dataset.manifest))
    started, copied_bytes = time.monotonic(), 0
    for number, name in enumerate(names, 1):
        copied_bytes += dataset.store.read(name, 0, 1).source_bytes  # a first read copies the shard whole
        rate = copied_bytes / max(time.monotonic() - started, 1e-9)
        print(f"{name}: shards {number}/{len(names)} in {directory}; {format_bytes(copied_bytes)} copied, "
              f"{format_bytes(int(rate))}/s", flush=True)
    print(f"--fill-cache {directory}: the {len(names)} shards of {data} are in the cache (a shard that did not fit "
          f"was said above)", flush=True)


def encoding_of(max_side: Optional[int], jpeg_quality: Optional[int]) -> dict:
    if max_side is None and jpeg_quality is None:
        return {"kind": "as-is"}
    return {"kind": "re-encoded", "max_side": max_side, "jpeg_quality": jpeg_quality or DEFAULT_JPEG_QUALITY}


def encoded(path: str, encoding: dict) -> bytes:
    """The bytes stored for the image at `path`: the file's own, or re-encoded."""
    with open(path, "rb") as handle:
        data = handle.read()
    if encoding["kind"] == "as-is":
        return data
    try:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")
            if encoding["max_side"] is not None:
                image.thumbnail((encoding["max_side"], encoding["max_side"]), Image.Resampling.BICUBIC)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=encoding["jpeg_quality"])
            return buffer.getvalue()
    except Exception:  # Pillow raises many types on bad data: stored as it is, for --bad-images to judge
        return data


def shard_plan(files: FileList, shard_bytes: int, shuffle_seed: Optional[int]) -> List[np.ndarray]:
    """The dataset indices of each shard, in member order: so many images per
    shard that their mean file size fills `shard_bytes`; shuffled by
    `shuffle_seed` (None: the dataset's order)."""
    if not len(files):
        return []
    mean_bytes = sum(os.path.getsize(files[index][0]) for index in range(len(files))) / len(files)
    per_shard = max(1, int(shard_bytes // (mean_bytes + TAR_HEADER_BYTES)))
    order = (np.random.default_rng(shuffle_seed).permutation(len(files)) if shuffle_seed is not None
             else np.arange(len(files)))
    return [order[start:start + per_shard] for start in range(0, len(files), per_shard)]


def write_shard(path: Path, indices: np.ndarray, files: FileList, encoding: dict) -> dict:
    """Shard `path` (written beside it, then renamed): per image a KEY.jpg and
    a KEY.cls member, KEY the dataset index; deterministic headers, so the
    same images make the same bytes. Returns its record: size, sha256, and
    each image's offset, size and crc32 inside it."""
    record: Dict[str, list] = {"indices": indices.tolist(), "offsets": [], "sizes": [], "crc32": []}

    def write(handle) -> None:
        with tarfile.open(fileobj=handle, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for index in indices.tolist():
                source, label = files[index]
                data = encoded(source, encoding)
                for suffix, payload in (("jpg", data), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{index:09d}.{suffix}")
                    info.size, info.mode, info.mtime = len(payload), 0o644, 0
                    if suffix == "jpg":
                        record["offsets"].append(tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors)))
                        record["sizes"].append(len(data))
                        record["crc32"].append(zlib.crc32(data))
                    tar.addfile(info, io.BytesIO(payload))

    atomic_write(path, write)
    size = path.stat().st_size
    return {"name": path.name, "bytes": size, "images": len(indices),
            "sha256": stored_sha256(LocalStore(str(path.parent)), path.name, size), **record}


def kept_record(out: Path, name: str, indices: np.ndarray) -> Optional[dict]:
    """The record of shard `name` finished by an earlier, interrupted pack,
    when the shard on disk still matches it (size, sha256, images); else None."""
    try:
        record = json.loads((out / WORK_FOLDER / f"{name}.json").read_text())
        size = (out / name).stat().st_size
    except (OSError, ValueError):
        return None
    if record.get("indices") != indices.tolist() or record.get("bytes") != size:
        return None
    return record if stored_sha256(LocalStore(str(out)), name, size) == record.get("sha256") else None


def write_npz(handle, arrays: Dict[str, np.ndarray]) -> None:
    """np.savez's format with fixed member times: the same arrays make the same bytes."""
    with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w") as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


def index_arrays(records: List[dict], files: FileList, data: Path) -> Dict[str, np.ndarray]:
    """A split's index: per dataset index its shard number, offset, size, crc32, class and source path."""
    count = len(files)
    arrays = {"shard": np.zeros(count, np.int32), "offset": np.zeros(count, np.int64),
              "size": np.zeros(count, np.int64), "crc32": np.zeros(count, np.uint32), "label": files.targets}
    for number, record in enumerate(records):
        indices = np.asarray(record["indices"], dtype=np.int64)
        arrays["shard"][indices] = number
        arrays["offset"][indices] = record["offsets"]
        arrays["size"][indices] = record["sizes"]
        arrays["crc32"][indices] = record["crc32"]
    paths = [os.fsencode(os.path.relpath(files[index][0], data)) for index in range(count)]
    arrays["path_bytes"], arrays["path_ends"] = pack(paths)
    return arrays


def options_record(args, lists: DatasetLists) -> dict:
    """What makes a pack: an interrupted one continues only under the same."""
    listed = hashlib.sha256()
    for split in SPLITS:
        for path, label in getattr(lists, split):
            listed.update(f"{path}\0{label}\n".encode("utf-8", "surrogateescape"))
    return {"source": str(args.data.resolve()), "files_sha256": listed.hexdigest(), "shard_size_bytes": args.shard_size,
            "encoding": encoding_of(args.max_side, args.jpeg_quality), "seed": args.seed}


def prepare_out(out: Path, options: dict) -> bool:
    """OUT made, or an interrupted pack's with the same options found (True: resumed)."""
    work = out / WORK_FOLDER
    if (out / MANIFEST_NAME).exists():
        raise UsageError(f"OUT {out}: holds a finished pack ({MANIFEST_NAME}); choose another folder (nothing is "
                         f"overwritten)")
    if (work / "options.json").exists():
        if json.loads((work / "options.json").read_text()) != options:
            raise UsageError(f"OUT {out}: holds an unfinished pack of another DATA or other options; run it with "
                             f"those, or choose another folder (nothing is overwritten)")
        for leftover in out.glob(".*.tmp-*"):  # a killed pack's unfinished shard
            leftover.unlink()
        return True
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"OUT {out}: exists and is not an empty folder; choose another (nothing is overwritten)")
    work.mkdir(parents=True, exist_ok=True)
    atomic_write(work / "options.json", lambda handle: handle.write(json.dumps(options, indent=1).encode()))
    return False


class Progress:
    """A line per shard: images/s, shards done, the time left."""

    def __init__(self, shards: int, images: int):
        self.shards, self.images = shards, images
        self.done_shards = self.done_images = self.written_images = 0
        self.started = time.monotonic()

    def shard_done(self, record: dict, kept: bool) -> None:
        self.done_shards += 1
        self.done_images += record["images"]
        if kept:
            print(f"{record['name']}: kept (finished by an earlier run)", flush=True)
            return
        self.written_images += record["images"]
        rate = self.written_images / max(time.monotonic() - self.started, 1e-6)
        left = (self.images - self.done_images) / rate
        print(f"{record['name']}: {record['images']:,} images, {format_bytes(record['bytes'])}; shards "
              f"{self.done_shards}/{self.shards}, {rate:,.0f} images/s, about {left:,.0f} s left", flush=True)


def pack_split(args, split: str, files: FileList, plans: List[np.ndarray], encoding: dict,
               progress: Progress) -> List[dict]:
    """A split's shards, each kept from an interrupted pack or written."""
    records = []
    for number, indices in enumerate(plans):
        name = shard_name(split, number)
        record = kept_record(args.out, name, indices)
        kept = record is not None
        if not kept:
            record = write_shard(args.out / name, indices, files, encoding)
            encoded_record = json.dumps(record).encode()
            atomic_write(args.out / WORK_FOLDER / f"{name}.json", lambda handle: handle.write(encoded_record))
        records.append(record)
        progress.shard_done(record, kept)
    return records


def split_entry(split: str, records: List[dict], files: FileList, classes: List[str], out: Path, data: Path) -> dict:
    """A split's part of the manifest; its index written."""
    path = out / index_name(split)
    atomic_write(path, lambda handle: write_npz(handle, index_arrays(records, files, data)))
    counts = np.bincount(files.targets.astype(np.int64), minlength=len(classes)).tolist()
    return {"images": len(files), "class_counts": counts,
            "shards": [{key: record[key] for key in ("name", "bytes", "images", "sha256")} for record in records],
            "index": {"name": path.name, "sha256": stored_sha256(LocalStore(str(out)), path.name, path.stat().st_size)}}


def pack_dataset(args) -> None:
    for split in SPLITS:
        if not (args.data / split).is_dir():
            raise UsageError(f"DATA {args.data}: no {split}/ folder (expected {args.data / split}/<class>/<images>)")
    if not args.out.parent.is_dir():
        raise UsageError(f"OUT {args.out}: no such folder {args.out.parent}")
    print(f"scanning {args.data} ...", flush=True)
    lists = scan_dataset(args.data)
    options = options_record(args, lists)
    if prepare_out(args.out, options):
        print(f"OUT {args.out}: an interrupted pack; its finished shards are checked and kept", flush=True)
    plans = {split: shard_plan(getattr(lists, split), args.shard_size, args.seed if split == "train" else None)
             for split in SPLITS}
    progress = Progress(sum(map(len, plans.values())), len(lists.train) + len(lists.val))
    splits = {}
    for split in SPLITS:
        files = getattr(lists, split)
        records = pack_split(args, split, files, plans[split], options["encoding"], progress)
        splits[split] = split_entry(split, records, files, lists.classes, args.out, args.data)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "classes": lists.classes, "splits": splits,
                "encoding": options["encoding"], "shuffle_seed": args.seed, "shard_size_bytes": args.shard_size,
                "source": options["source"], "tool_version": TOOL_VERSION}
    atomic_write(args.out / MANIFEST_NAME, lambda handle: handle.write(json.dumps(manifest, indent=1).encode()),
                 overwrite=False)
    shutil.rmtree(args.out / WORK_FOLDER, ignore_errors=True)
    total = sum(shard["bytes"] for split in splits.values() for shard in split["shards"])
    print(f"{args.out}: {len(lists.train):,} training and {len(lists.val):,} validation images in "
          f"{sum(len(split['shards']) for split in splits.values())} shards, {format_bytes(total)}", flush=True)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.fill_cache is not None:
        if args.out is not None or args.verify:
            raise UsageError("argument --fill-cache: takes DATA alone (python -m common.tools.pack_shards "
                             "--fill-cache DIR DATA)")
        fill_cache(args.data, args.fill_cache, args.s3_endpoint_url)
        return
    if args.s3_endpoint_url is not None:
        raise UsageError("argument --s3-endpoint-url: only with --fill-cache")
    args.data = Path(args.data)
    if args.verify:
        if args.out is not None:
            raise UsageError("argument --verify: takes one folder, the shards' (python -m common.tools.pack_shards "
                             "--verify OUT)")
        problems = verify(LocalStore(str(args.data)))
        if problems:
            raise UsageError(f"DATA {args.data}: {len(problems)} damaged: {'; '.join(problems)}")
        print(f"{args.data}: every shard and index matches its manifest", flush=True)
        return
    if args.out is None:
        raise UsageError("OUT: missing; give the folder to write the shards into")
    try:
        pack_dataset(args)
    except OSError as error:  # a source file that cannot be read, an OUT that cannot be written (a full disk)
        where = error.filename or args.out
        raise UsageError(f"{where}: {error.strerror or error_summary(error)} (run the same command again to "
                         f"continue: finished shards are kept)") from None


if __name__ == "__main__":
    run_main(main)

"""Sharded datasets: the pack tool (common.tools.pack_shards), its manifest,
shards and index; reading them back (common.shards) as the folder tree's
dataset reads files; the flags that go with them. Data made here, packed
once per module."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common import cli, data, shards
from common.arguments import byte_size
from common.dataset_lists import SPLITS, scan_dataset
from common.errors import USAGE_EXIT_STATUS, UsageError
from common.image_files import BadImageError
from common.pipelines import EncodedImages, PILImages, TensorImages, train_transform
from common.tools import pack_shards
from helpers import make_image_folder

SHARD_BYTES = "10K"  # 4 of the test's images a shard: several shards per split


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("shards") / "data")  # 24 training and 9 val images, 3 classes


@pytest.fixture(scope="module")
def packed(tree) -> Path:
    out = tree.parent / "packed"
    pack_shards.main([str(tree), str(out), "--shard-size", SHARD_BYTES, "--seed", "3"])
    return out


def manifest_of(out: Path) -> dict:
    return json.loads((out / shards.MANIFEST_NAME).read_text())


def file_bytes(path) -> bytes:
    return Path(path).read_bytes()


def folder_contents(folder: Path) -> dict:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_the_manifest_holds_the_sources_classes_counts_and_each_files_checksum(tree, packed):
    manifest, lists = manifest_of(packed), scan_dataset(tree)
    assert (manifest["format"], manifest["version"]) == (shards.FORMAT_NAME, shards.FORMAT_VERSION)
    assert manifest["classes"] == lists.classes == ["class_0", "class_1", "class_2"]
    assert manifest["encoding"] == {"kind": "as-is"} and manifest["source"] == str(tree.resolve())
    for split, images, per_class in (("train", 24, 8), ("val", 9, 3)):
        entry = manifest["splits"][split]
        assert entry["images"] == images and entry["class_counts"] == [per_class] * 3
        assert sum(shard["images"] for shard in entry["shards"]) == images
        assert len(entry["shards"]) == -(-images // 4)  # 10 KB shards of ~1 KB images and their headers
        for shard in entry["shards"] + [entry["index"]]:
            assert hashlib.sha256(file_bytes(packed / shard["name"])).hexdigest() == shard["sha256"]
        for shard in entry["shards"]:
            assert (packed / shard["name"]).stat().st_size == shard["bytes"]
    assert sorted(path.name for path in packed.iterdir()) == sorted(
        [shards.MANIFEST_NAME, "train-index.npz", "val-index.npz"]
        + [shard["name"] for split in ("train", "val") for shard in manifest["splits"][split]["shards"]])


def test_each_shard_is_webdataset_pairs_of_the_files_bytes_and_class(tree, packed):
    lists = scan_dataset(tree)
    members_in_order = {}
    for split in ("train", "val"):
        keys = []
        for shard in manifest_of(packed)["splits"][split]["shards"]:
            with tarfile.open(packed / shard["name"]) as tar:
                members = tar.getmembers()
                assert [member.name.split(".", 1)[1] for member in members] == ["jpg", "cls"] * (len(members) // 2)
                for image, label in zip(members[::2], members[1::2]):
                    key = image.name.split(".")[0]
                    assert label.name == f"{key}.cls" and image.name == f"{key}.jpg"  # one dot: webdataset's key
                    path, target = getattr(lists, split)[int(key)]
                    assert tar.extractfile(image).read() == file_bytes(path)
                    assert tar.extractfile(label).read() == str(target).encode()
                    keys.append(int(key))
        members_in_order[split] = keys
    assert sorted(members_in_order["train"]) == list(range(24)) and members_in_order["val"] == list(range(9))
    assert members_in_order["train"] != list(range(24))  # shuffled: a streaming reader meets mixed classes


def test_a_sharded_split_reads_every_image_as_the_tree_holds_it(tree, packed):
    dataset, lists = shards.open_sharded(str(packed)), scan_dataset(tree)
    assert dataset.classes == lists.classes
    for split in ("train", "val"):
        sharded, files = getattr(dataset, split), getattr(lists, split)
        assert len(sharded) == len(files)
        for index in range(len(files)):
            fetched = sharded.read(index)
            assert fetched.data == file_bytes(files[index][0])
            assert (fetched.source_bytes, fetched.cache_bytes) == (len(fetched.data), 0)
            assert sharded.label(index) == files[index][1]
            assert sharded.name(index) == f"{Path(files[index][0]).relative_to(tree)} (in {sharded.shard(index)})"


# encoded: what the workers of the gpu and dali backends hand over (the file's bytes and the crop)
@pytest.mark.parametrize("backend", ["torchvision", "pil", "encoded"])
def test_the_shards_give_the_trees_samples_crops_and_byte_counts(tree, packed, backend):
    sharded, lists = shards.open_sharded(str(packed)), scan_dataset(tree)
    pipeline = {"torchvision": TensorImages(True, 16, reduced_decode=False), "encoded": EncodedImages(True, 16),
                "pil": PILImages(train_transform(16))}[backend]
    on_files = data.ImageFolderDataset(lists.train, pipeline, augmentation_seed=5)
    on_shards = data.ImageFolderDataset(sharded.train, pipeline, augmentation_seed=5)
    for epoch in (0, 1):
        on_files.epoch = on_shards.epoch = epoch
        for index in (0, 7, 23):
            ours, theirs = on_shards[index], on_files[index]
            same = (torch.equal(ours.image.data, theirs.image.data) and ours.image.geometry == theirs.image.geometry
                    if backend == "encoded" else torch.equal(ours.image, theirs.image))
            assert same and ours.target == theirs.target
            assert ours.file_bytes == theirs.file_bytes == ours.source_bytes == theirs.source_bytes > 0
            assert ours.cache_bytes == theirs.cache_bytes == 0


def test_an_interrupted_pack_writes_only_the_missing_shards_and_equals_an_uninterrupted_one(
        tree, packed, tmp_path, monkeypatch):
    out, written, real_write = tmp_path / "out", [], pack_shards.write_shard

    def interrupted_after_two(path, *args):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(path.name)
        return real_write(path, *args)

    monkeypatch.setattr(pack_shards, "write_shard", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        pack_shards.main([str(tree), str(out), "--shard-size", SHARD_BYTES, "--seed", "3"])
    assert not (out / shards.MANIFEST_NAME).exists()
    finished = {name: (out / name).stat() for name in written}
    monkeypatch.setattr(pack_shards, "write_shard", lambda path, *args: written.append(path.name) or
                        real_write(path, *args))
    pack_shards.main([str(tree), str(out), "--shard-size", SHARD_BYTES, "--seed", "3"])
    total = sum(len(entry["shards"]) for entry in manifest_of(packed)["splits"].values())
    assert len(written) == total and len(set(written)) == total  # the two finished shards were not written again
    for name, before in finished.items():
        after = (out / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert folder_contents(out) == folder_contents(packed)  # byte for byte, manifest and indexes included


def test_an_out_holding_anything_else_is_refused_and_left_alone(tree, packed, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"OUT .*other: exists and is not an empty folder"):
        pack_shards.main([str(tree), str(other)])
    with pytest.raises(UsageError, match=r"holds a finished pack"):
        pack_shards.main([str(tree), str(packed)])
    unfinished = tmp_path / "unfinished"
    pack_shards.prepare_out(unfinished, {"source": "elsewhere"})
    with pytest.raises(UsageError, match=r"an unfinished pack of another DATA or other options"):
        pack_shards.main([str(tree), str(unfinished)])
    assert (other / "notes.txt").read_text() == "mine" and manifest_of(packed)["classes"]


def test_re_encoding_shrinks_the_images_and_is_recorded(tmp_path):
    tree = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1, size=96)
    out = tmp_path / "out"
    pack_shards.main([str(tree), str(out), "--max-side", "40", "--jpeg-quality", "60"])
    manifest = manifest_of(out)
    assert manifest["encoding"] == {"kind": "re-encoded", "max_side": 40, "jpeg_quality": 60}
    dataset, lists = shards.open_sharded(str(out)), scan_dataset(tree)
    for index in range(len(lists.train)):
        stored = dataset.train.read(index).data
        assert len(stored) < len(file_bytes(lists.train[index][0]))
        with Image.open(io.BytesIO(stored)) as image:
            assert image.size == (40, 40) and image.format == "JPEG"


def damaged_copy(packed: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    return copy


def test_a_missing_or_cut_shard_is_one_line_naming_it(packed, tmp_path):
    copy = damaged_copy(packed, tmp_path)
    (copy / "train-000002.tar").unlink()
    with pytest.raises(UsageError, match=r"^DATA .*copy: train-000002.tar is missing \(named by its manifest\)$"):
        shards.open_sharded(str(copy))
    shutil.copy(packed / "train-000002.tar", copy / "train-000002.tar")
    with open(copy / "val-000001.tar", "r+b") as handle:
        handle.truncate(5000)
    with pytest.raises(UsageError, match=r"shard val-000001.tar is 5,000 bytes, its manifest says 20,480 .*--verify"):
        shards.open_sharded(str(copy))


def test_verify_names_every_damaged_shard_with_exit_status_2(packed, tmp_path, capsys):
    pack_shards.main(["--verify", str(packed)])
    assert "every shard and index matches its manifest" in capsys.readouterr().out
    copy = damaged_copy(packed, tmp_path)
    with open(copy / "train-000001.tar", "r+b") as handle:
        handle.seek(3000)
        byte = handle.read(1)
        handle.seek(3000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    (copy / "val-000000.tar").unlink()
    with pytest.raises(UsageError) as raised:
        pack_shards.main(["--verify", str(copy)])
    assert str(raised.value) == (f"DATA {copy}: 2 damaged: train-000001.tar differs from its sha256; "
                                 f"val-000000.tar missing")
    assert raised.value.status == USAGE_EXIT_STATUS


def test_an_image_damaged_inside_a_shard_is_a_bad_image_for_skip_and_fail(packed, tmp_path):
    copy = damaged_copy(packed, tmp_path)
    split = shards.open_sharded(str(copy)).train
    offset, shard = int(split.arrays["offset"][5]), split.shard(5)
    with open(copy / shard, "r+b") as handle:
        handle.seek(offset + 100)
        handle.write(b"\0\0\0\0")
    pipeline = TensorImages(False, 16, val_resize=16)
    with pytest.raises(BadImageError, match=rf"^train/class_0/005.JPEG \(in {shard}\): cannot decode image \(damaged "
                                            rf"in {shard}: crc32 [0-9a-f]{{8}}, its index says [0-9a-f]{{8}}\)"):
        data.ImageFolderDataset(split, pipeline)[5]
    skipping = data.ImageFolderDataset(split, pipeline, skip_bad_images=True)
    batch = data.collate([skipping[index] for index in range(24)])
    bad = data.BadImages(skipping)
    assert bad.count(batch) == 1
    assert list(bad.reasons) == [f"train/class_0/005.JPEG (in {shard})"]
    assert batch.target.tolist()[5] == split.label(6)  # the next readable image stands in
    assert int(batch.bad_index[5]) == 5 and (batch.bad_index >= 0).sum() == 1


@pytest.mark.parametrize("argv, message", [
    (["--data-cache", "{tmp}/cache"], "argument --data-cache: not here: it caches shards; DATA is no sharded dataset"),
    (["--data-cache-size", "1G"], "argument --data-cache-size: not here: it sizes --data-cache, not given"),
    (["--s3-endpoint-url", "http://127.0.0.1:9000"], "argument --s3-endpoint-url: not here: DATA is no s3:// URL"),
])
def test_the_shard_flags_are_refused_without_shards(tree, tmp_path, argv, message):
    with pytest.raises(UsageError) as raised:
        cli.parse("nd", [str(tree), *[word.format(tmp=tmp_path) for word in argv]])
    assert str(raised.value).startswith(message)


def test_the_shard_flags_reach_the_config_and_their_mistakes_are_one_line(packed, tmp_path):
    cfg = cli.parse("nd", [str(packed), "--data-cache", str(tmp_path), "--data-cache-size", "500G"])
    assert (cfg.data_cache, cfg.data_cache_bytes) == (str(tmp_path), 500 * 10 ** 9)
    cfg = cli.parse("nd", ["s3://bucket/imagenet", "--s3-endpoint-url", "http://127.0.0.1:9000"])
    assert (cfg.data, cfg.s3_endpoint_url) == ("s3://bucket/imagenet", "http://127.0.0.1:9000")
    with pytest.raises(UsageError, match=r"argument --file-list: not here: a sharded DATA lists its images"):
        cli.parse("nd", [str(packed), "--file-list", str(packed / shards.MANIFEST_NAME)])
    for url in ("s3://AKIA1234:s3cret@bucket/imagenet", "s3://AKIA1234:s3/cret@bucket/imagenet"):  # '/': base64
        with pytest.raises(UsageError) as raised:
            cli.parse("nd", [url])
        assert "(credentials?) is refused" in str(raised.value) and "cret" not in str(raised.value)
    with pytest.raises(UsageError, match=r"argument --s3-endpoint-url: .*expected http\(s\)://HOST\[:PORT\]"):
        cli.parse("nd", ["s3://bucket/x", "--s3-endpoint-url", "http://user:pw@host:9000"])
    with pytest.raises(UsageError, match=r"DATA s3://: no bucket"):
        cli.parse("nd", ["s3://"])


def test_fill_cache_copies_every_shard_once_so_training_reads_none_from_the_source(packed, tmp_path, capsys):
    """A job's stage-in, once per node: after it, the cache serves every read; run again, it copies nothing."""
    pack_shards.main(["--fill-cache", str(tmp_path / "cache"), str(packed)])
    names = [shard["name"] for split in SPLITS for shard in manifest_of(packed)["splits"][split]["shards"]]
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith(f"--fill-cache {tmp_path / 'cache'}: the {len(names)} shards of {packed}")
    assert sorted(name.split("-", 1)[1] for name in os.listdir(tmp_path / "cache") if name.endswith(".tar")) == \
        sorted(names)
    dataset = shards.open_sharded(str(packed), str(tmp_path / "cache"))
    reads = [dataset.train.read(index) for index in range(len(dataset.train))]
    assert sum(read.source_bytes for read in reads) == 0 and all(read.cache_bytes for read in reads)
    pack_shards.main(["--fill-cache", str(tmp_path / "cache"), str(packed)])
    assert "0 B copied" in capsys.readouterr().out.splitlines()[-2]
    with pytest.raises(UsageError, match="argument --s3-endpoint-url: only with --fill-cache"):
        pack_shards.main([str(packed), str(tmp_path / "out"), "--s3-endpoint-url", "http://127.0.0.1:9000"])


def test_sizes_take_decimal_and_binary_units():
    assert [byte_size(text) for text in ("500G", "200M", "256MiB", "1.5T", "4096", "10k")] == [
        500 * 10 ** 9, 200 * 10 ** 6, 256 << 20, 1_500_000_000_000, 4096, 10_000]
    with pytest.raises(Exception, match="expected a size such as 200M"):
        byte_size("lots")


def test_the_index_is_per_dataset_index(packed):
    split = shards.open_sharded(str(packed)).val
    assert np.array_equal(split.arrays["shard"], np.repeat([0, 1, 2], [4, 4, 1]))  # val is packed in its order
    assert [split.path(index) for index in (0, 8)] == ["val/class_0/000.JPEG", "val/class_2/002.JPEG"]

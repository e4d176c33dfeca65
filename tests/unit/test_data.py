"""Data: folder scanning, class mapping, samplers, reproducible epochs, the
demo and fake-ImageNet generators, and the unreadable-image policy."""
import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from common import data, dataset_lists
from common.cli import parse
from common.errors import UsageError
from common.data import ShardSampler, build_loaders
from common.dataset_lists import scan_split
from common.image_files import BadImageError, read_rgb
from common.tools.demo_data import DIGITS_CLASSES, write_digits, write_fake_imagenet
from common.distributed import Context
from helpers import FAST_ARGS, make_image_folder, memory_capped

CPU = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_scan_uses_train_classes_for_val(tmp_path):
    root = make_image_folder(tmp_path, classes=3, train_per_class=2, val_per_class=1)
    # val/ lacks class_0: indices must still follow train/'s mapping.
    for path in (root / "val" / "class_0").iterdir():
        path.unlink()
    (root / "val" / "class_0").rmdir()
    classes, train = scan_split(root / "train")
    _, val = scan_split(root / "val", {name: index for index, name in enumerate(classes)})
    assert classes == ["class_0", "class_1", "class_2"]
    assert [target for _, target in train] == [0, 0, 1, 1, 2, 2]
    assert [target for _, target in val] == [1, 2]


def test_scan_ignores_non_images_and_hidden_files_and_matches_extensions_case_insensitively(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=2, val_per_class=1)
    folder = root / "train" / "class_0"
    (folder / ".DS_Store").write_bytes(b"\0\0")
    (folder / "notes.txt").write_text("not an image")
    Image.new("RGB", (8, 8)).save(folder / "extra.png")
    (root / "train" / ".hidden_class").mkdir()
    classes, samples = scan_split(root / "train")
    assert classes == ["class_0", "class_1"]
    names = sorted(Path(path).name for path, target in samples if target == 0)
    assert names == ["000.JPEG", "001.JPEG", "extra.png"]


def test_scan_follows_symlinked_class_folders(tmp_path):
    root = make_image_folder(tmp_path / "a", classes=2, train_per_class=3, val_per_class=1)
    elsewhere = tmp_path / "elsewhere"
    (root / "train" / "class_1").rename(elsewhere)
    (root / "train" / "class_1").symlink_to(elsewhere, target_is_directory=True)
    _, samples = scan_split(root / "train")
    assert sum(1 for _, target in samples if target == 1) == 3


def test_empty_class_folder_is_named(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=1, val_per_class=1)
    (root / "train" / "class_9").mkdir()
    with pytest.raises(UsageError, match=r"train/class_9: class folder has no images"):
        scan_split(root / "train")


def test_val_class_missing_from_train_is_named(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=1, val_per_class=1)
    make_image_folder(tmp_path / "more", classes=3, train_per_class=1, val_per_class=1)
    (tmp_path / "more" / "val" / "class_2").rename(root / "val" / "class_2")
    with pytest.raises(UsageError, match=r"val/class_2: class 'class_2' is not among the classes of train/"):
        scan_split(root / "val", {"class_0": 0, "class_1": 1})


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 60), st.integers(1, 9))
def test_shard_sampler_counts_every_index_exactly_once(length, world_size):
    shards = [list(ShardSampler(length, rank, world_size)) for rank in range(world_size)]
    assert sorted(index for shard in shards for index in shard) == list(range(length))
    assert [len(ShardSampler(length, rank, world_size)) for rank in range(world_size)] == [len(s) for s in shards]


def _batches(loader, count=None):
    return [(images.clone(), target.clone()) for images, target, *_ in list(loader)[:count]]


def test_epoch_order_and_augmentation_depend_only_on_seed_and_epoch(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=6, val_per_class=1)
    cfg = parse("nd", [str(root), *FAST_ARGS, "-j", "2"])
    loaders = build_loaders(cfg, CPU)
    loaders.set_epoch(0)
    epoch0 = _batches(loaders.train)
    loaders.set_epoch(1)
    epoch1 = _batches(loaders.train)
    # A fresh process-like state (new loaders, other global RNG) that jumps straight to epoch 1.
    torch.manual_seed(12345)
    again = build_loaders(cfg, CPU)
    again.set_epoch(1)
    epoch1_again = _batches(again.train)
    assert len(epoch1) == len(epoch1_again) == len(epoch0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(epoch1, epoch1_again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(epoch0, epoch1))  # a new shuffle and new crops
    assert len(epoch1) == 12 // 4  # drop_last with 12 images and -b 4


def test_other_seed_changes_the_order(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=8, val_per_class=1)
    cfg = parse("nd", [str(root), *FAST_ARGS, "-j", "0"])
    orders = []
    for seed in (0, 1):
        loaders = build_loaders(dataclasses.replace(cfg, seed=seed), CPU)
        loaders.set_epoch(0)
        orders.append(list(loaders.train.sampler))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(16))
    assert orders[0] != orders[1]


@pytest.mark.parametrize("images", [20, 21])
def test_two_ranks_train_on_disjoint_shares_covering_the_set_with_a_new_shuffle_each_epoch(tmp_path, images):
    root = make_image_folder(tmp_path, classes=1, train_per_class=images, val_per_class=1)
    cfg = parse("ddp", [str(root), *FAST_ARGS, "-j", "0"])  # -b 4: global batches of 8
    ranks = [build_loaders(cfg, dataclasses.replace(CPU, rank=rank, world_size=2)) for rank in (0, 1)]
    orders = []
    for epoch in (0, 1):
        shares = []
        for loaders in ranks:
            assert loaders.set_epoch(epoch) == range(0, 2)
            shares.append(list(loaders.train.sampler))
        assert len(shares[0]) == len(shares[1]) == 8  # equal steps on every rank: 2 whole global batches
        assert not set(shares[0]) & set(shares[1])  # disjoint, no image repeated to even out the shares
        assert len(set(shares[0]) | set(shares[1])) == 16  # the 4 or 5 left over make no whole global batch
        orders.append(shares)
    assert orders[0][0] != orders[1][0] and orders[0][1] != orders[1][1]


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 200), batch=st.integers(1, 9), world=st.integers(1, 5), new_world=st.integers(1, 5),
       steps_done=st.integers(0, 30), epoch=st.integers(0, 3))
def test_any_world_size_trains_on_a_prefix_of_one_permutation_and_a_resume_continues_it(
        length, batch, world, new_world, steps_done, epoch):
    def global_batches(world_size, images_done=0):
        samplers = [data.TrainSampler(length, rank, world_size, batch, seed=3) for rank in range(world_size)]
        steps = [sampler.set_epoch(epoch, images_done) for sampler in samplers][0]
        shares = [list(sampler) for sampler in samplers]
        # Global batch k: every rank's k-th batch.
        return steps, [sorted(index for share in shares for index in share[k * batch:(k + 1) * batch])
                       for k in range(len(steps))]

    order = torch.randperm(length, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
    steps, batches = global_batches(world)
    assert len(steps) == length // (batch * world)
    assert batches == [sorted(order[k * batch * world:(k + 1) * batch * world]) for k in range(len(steps))]
    # Stopped after `done` steps, resumed by new_world processes: the rest of the same permutation,
    # in global batches of the new size, no image twice, none of the whole new batches skipped.
    done = min(steps_done, len(steps))
    images_done = done * batch * world
    steps_after, batches_after = global_batches(new_world, images_done)
    assert steps_after.stop == length // (batch * new_world)
    rest = order[images_done:]
    assert batches_after == [sorted(rest[k * batch * new_world:(k + 1) * batch * new_world])
                             for k in range(len(steps_after))]
    assert len(steps_after) == max(0, (steps_after.stop * batch * new_world - images_done) // (batch * new_world))


def test_crops_depend_on_the_image_and_epoch_not_on_the_process_or_worker_reading_it(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=8, val_per_class=1)
    cfg = parse("ddp", [str(root), *FAST_ARGS])

    def images_by_index(world_size, workers, epoch=1):
        seen = {}
        for rank in range(world_size):
            loaders = build_loaders(dataclasses.replace(cfg, workers=workers),
                                    dataclasses.replace(CPU, rank=rank, world_size=world_size))
            loaders.set_epoch(epoch)
            indices = list(loaders.train.sampler)
            images = torch.cat([batch[0] for batch in loaders.train])
            seen.update({index: image for index, image in zip(indices, images)})
        return seen

    one = images_by_index(1, 0)
    two = images_by_index(2, 2)
    assert sorted(one) == sorted(two) and len(one) == 16
    assert all(torch.equal(one[index], two[index]) for index in one)
    other_epoch = images_by_index(1, 0, epoch=2)
    assert not all(torch.equal(one[index], other_epoch[index]) for index in one)


def test_data_parallel_feeds_one_batch_per_gpu_from_one_process(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=8, val_per_class=3)
    cfg = parse("dp", [str(root), *FAST_ARGS, "-j", "0"])
    loaders = build_loaders(cfg, dataclasses.replace(CPU, replicas_per_process=2))
    assert loaders.train.batch_size == loaders.val.batch_size == 2 * 4
    assert len(loaders.train) == 16 // 8


@pytest.mark.parametrize("script, extra, world_size, replicas_per_process", [
    ("nd", [], 1, 1), ("dp", [], 1, 2), ("ddp", ["--accum-steps", "3"], 2, 1)])
def test_the_sampler_cuts_the_global_batch_the_plan_logs_scales_and_saves(
        tmp_path, script, extra, world_size, replicas_per_process):
    from common import precision, session
    root = make_image_folder(tmp_path, classes=2, train_per_class=24, val_per_class=2)
    cfg = parse(script, [str(root), *FAST_ARGS, "-j", "0", *extra])
    ctx = dataclasses.replace(CPU, world_size=world_size, replicas_per_process=replicas_per_process)
    plan = session.Plan.of(cfg, ctx, precision.FP32())
    assert plan.global_batch == cfg.batch_size * cfg.accum_steps * world_size * replicas_per_process
    assert build_loaders(cfg, ctx).global_batch == plan.global_batch


def test_batch_larger_than_the_training_set_is_refused(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=3, val_per_class=1)
    cfg = parse("nd", [str(root), *FAST_ARGS, "-b", "7"])
    with pytest.raises(UsageError, match=r"-b/--batch-size: 7 per process is more than the 6 training images"):
        build_loaders(cfg, CPU)


def test_synthetic_loaders_need_no_disk():
    cfg = parse("nd", ["--synthetic", "-b", "8", "--image-size", "16", "--val-resize", "16", "-j", "0"])
    loaders = build_loaders(cfg, CPU)
    assert len(loaders.train.dataset) == data.IMAGENET_TRAIN_IMAGES
    assert len(loaders.val.dataset) == data.SYNTHETIC_VAL_BATCHES * 8
    assert loaders.num_classes == 1000
    images, target, *_ = next(iter(loaders.val))
    assert images.shape == (8, 3, 16, 16) and target.tolist() == list(range(8))


def test_synthetic_images_no_machine_holds_are_one_line_before_they_are_drawn():
    with memory_capped():  # the job's memory, as common.arguments.memory_bytes sees it: 2 GiB more than now
        # One 10,000-pixel image (1.2 GB as float32 input) fits; the 64 distinct ones synthetic data draws do not.
        cfg = parse("nd", ["--synthetic", "-b", "1", "--image-size", "10000", "--val-resize", "10000", "-j", "0"])
        with pytest.raises(UsageError, match=r"^argument --image-size: --synthetic's 64 distinct 10000x10000 images "
                                             r"would take 19.2 GB, more than the "):
            build_loaders(cfg, CPU)


def test_synthetic_data_says_that_data_is_not_read(tmp_path):
    args = ["-b", "8", "--image-size", "16", "--val-resize", "16", "-j", "0"]
    ignored = build_loaders(parse("nd", ["--synthetic", str(tmp_path / "imagenet"), *args]), CPU)
    assert ignored.notes == [f"note: --synthetic: DATA {tmp_path / 'imagenet'} is not read; random images stand "
                             f"in for it"]
    assert build_loaders(parse("nd", ["--synthetic", *args]), CPU).notes == []


def test_more_data_loading_workers_than_cores_are_one_note_for_the_node_not_torchs_two_lines_per_process(
        monkeypatch):
    import os
    import warnings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one core, for torch's check and ours
    args = ["--synthetic", "-b", "8", "--image-size", "16", "--val-resize", "16"]
    with warnings.catch_warnings(record=True) as warned:
        one = build_loaders(parse("ddp", [*args, "-j", "2"]), CPU)
        two = build_loaders(parse("ddp", [*args, "-j", "2"]), dataclasses.replace(CPU, world_size=2, procs_per_node=2))
        fits = build_loaders(parse("ddp", [*args, "-j", "1"]), CPU)
    assert one.notes == ["warning: -j 2 = 2 data-loading processes on this node's 1 core(s): oversubscribed, they "
                         "take turns; -j 1 or fewer runs as fast"]
    assert two.notes == ["warning: -j 2 x 2 training processes = 4 data-loading processes on this node's 1 core(s): "
                         "oversubscribed, they take turns; -j 1 or fewer runs as fast"]
    assert fits.notes == []
    assert [str(warning.message) for warning in warned if "DataLoader will create" in str(warning.message)] == []


def test_a_class_folder_linked_to_another_class_or_split_is_named(tmp_path):
    """train/class_1 -> ../val/class_1 trains on the validation images; train/class_2 -> class_0 gives
    class_0's files two labels. Both are said once, naming both folders; the files still count under both."""
    root = make_image_folder(tmp_path / "data", classes=3, train_per_class=2, val_per_class=1)
    for name, target in (("class_1", root / "val" / "class_1"), ("class_2", root / "train" / "class_0")):
        for path in (root / "train" / name).iterdir():
            path.unlink()
        (root / "train" / name).rmdir()
        (root / "train" / name).symlink_to(target, target_is_directory=True)
    loaders = build_loaders(parse("nd", [str(root), *FAST_ARGS, "-j", "0"]), CPU)
    files = [(Path(path).resolve().parent.relative_to(root.resolve()).as_posix(), label)
             for path, label in loaders.train.dataset.samples]
    assert files == [("train/class_0", 0)] * 2 + [("val/class_1", 1)] + [("train/class_0", 2)] * 2
    warned = sorted(note for note in loaders.notes if note.startswith("warning: "))
    assert len(warned) == 2, loaders.notes
    two_labels, leak = warned
    assert two_labels.startswith(f"warning: {root / 'train' / 'class_2'} reaches the same files as "
                                 f"{root / 'train' / 'class_0'} ({(root / 'train' / 'class_0').resolve()}, ")
    assert leak.startswith(f"warning: {root / 'val' / 'class_1'} reaches the same files as "
                           f"{root / 'train' / 'class_1'} ({(root / 'val' / 'class_1').resolve()}, ")
    plain = build_loaders(parse("nd", [str(make_image_folder(tmp_path / "plain")), *FAST_ARGS, "-j", "0"]), CPU)
    assert not [note for note in plain.notes if note.startswith("warning: ")]


def test_every_image_mode_becomes_rgb(tmp_path):
    paths = {}
    for mode in ("L", "RGBA", "CMYK", "P", "I;16"):
        path = tmp_path / f"{mode.replace(';', '')}.{'jpg' if mode in ('L', 'CMYK') else 'png'}"
        Image.new(mode, (5, 4)).save(path)
        paths[mode] = path
    png_named_jpeg = tmp_path / "really_png.JPEG"  # ImageNet has one: a PNG saved as .JPEG
    Image.new("RGB", (5, 4), (1, 2, 3)).save(png_named_jpeg, format="PNG")
    paths["png-as-jpeg"] = png_named_jpeg
    for path in paths.values():
        image, file_bytes = read_rgb(str(path))
        assert image.mode == "RGB" and image.size == (5, 4) and file_bytes == path.stat().st_size
    assert read_rgb(str(png_named_jpeg))[0].getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize("damage", ["truncated", "zero-bytes", "garbage"])
def test_unreadable_image_raises_one_line_naming_the_file(tmp_path, damage):
    path = tmp_path / "bad.JPEG"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    content = path.read_bytes()
    path.write_bytes({"truncated": content[: len(content) // 2], "zero-bytes": b"",
                      "garbage": b"GIF89a not really"}[damage])
    with pytest.raises(BadImageError) as caught:
        read_rgb(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: cannot decode image") and "\n" not in message


def test_bad_image_error_survives_a_dataloader_worker(tmp_path):
    root = make_image_folder(tmp_path, classes=2, train_per_class=2, val_per_class=1)
    bad = root / "val" / "class_1" / "000.JPEG"
    bad.write_bytes(bad.read_bytes()[:100])
    cfg = parse("nd", [str(root), *FAST_ARGS, "-b", "2", "-j", "1"])
    loaders = build_loaders(cfg, CPU)
    with pytest.raises(BadImageError) as caught:
        list(loaders.val)
    assert str(caught.value).startswith(f"{bad}: cannot decode image")
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_digits_dataset(tmp_path):
    counts = write_digits(tmp_path / "digits")
    assert counts == {"train": 1438, "val": 359}  # 1,797 images, 20% of each class to val/
    root = tmp_path / "digits"
    classes, train = scan_split(root / "train")
    _, val = scan_split(root / "val", {name: index for index, name in enumerate(classes)})
    assert classes == DIGITS_CLASSES
    assert len(train) == 1438 and len(val) == 359
    per_class_val = np.bincount([target for _, target in val], minlength=10)
    assert per_class_val.min() >= 35 and per_class_val.max() <= 37  # stratified: 178..183 per class x 0.2
    assert not {Path(p).name for p, _ in train} & {Path(p).name for p, _ in val}  # disjoint
    with Image.open(train[0][0]) as image:
        assert image.format == "JPEG" and image.size == (64, 64)
    # Same parameters: the folder is reused, not rewritten.
    stamp = (root / "dataset.json").stat().st_mtime_ns
    assert write_digits(root) == counts
    assert (root / "dataset.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_dataset_writer_never_overwrites_a_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(UsageError, match="exists and is not a dataset"):
        write_digits(tmp_path / "mine")
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"
    write_digits(tmp_path / "small", image_size=16)
    with pytest.raises(UsageError, match="exists and is not a dataset written with these parameters"):
        write_digits(tmp_path / "small", image_size=48)  # other parameters: refused, not rewritten
    with Image.open(next((tmp_path / "small" / "train").rglob("*.JPEG"))) as image:
        assert image.size == (16, 16)


def test_a_fake_imagenet_the_disk_has_no_room_for_is_refused_before_anything_is_listed_or_written(tmp_path):
    from common.tools import demo_data

    # 2 x 10**15 folders: their list alone once took the machine's memory, before the disk filled.
    with memory_capped(), pytest.raises(UsageError, match=rf"^{tmp_path}: 110,000,000,000,000,000 images of about "
                                                          r"100 KB need [\d.]+ TB or more, and [\d.]+ [KMGT]?B is "
                                                          r"free there; ask for fewer \(--classes, "):
        demo_data.main(["fake-imagenet", str(tmp_path / "fake"), "--classes", str(10**15)])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match=r"^argument --image-size: one 1000000000x1000000000 digit image would take"):
        demo_data.main(["digits", str(tmp_path / "digits"), "--image-size", str(10**9)])


def test_fake_imagenet_is_imagenet_shaped(tmp_path):
    counts = write_fake_imagenet(tmp_path / "fake", classes=2, train_per_class=5, val_per_class=2)
    files = sorted((tmp_path / "fake").rglob("*.JPEG"))
    assert len(files) == counts["train"] + counts["val"] == 14
    sizes = [path.stat().st_size for path in files]
    assert counts["bytes"] == sum(sizes)
    assert 80_000 <= sum(sizes) / len(sizes) <= 130_000  # ImageNet's JPEGs average about 110 KB
    for path in files:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert 450 <= image.width <= 500 and 333 <= image.height <= 375
    marker = json.loads((tmp_path / "fake" / "dataset.json").read_text())
    assert marker["parameters"]["classes"] == 2


def test_damaged_dataset_marker_is_refused_not_a_traceback(tmp_path):
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "dataset.json").write_text("{ not json")
    with pytest.raises(UsageError, match="exists and is not a dataset"):
        write_digits(tmp_path / "digits")


# --- the compact file list (common.dataset_lists) ---

def test_a_file_list_is_a_read_only_sequence_of_its_samples():
    import pickle

    from common.dataset_lists import FileList

    pairs = [("/d/train/b/1.JPEG", 1), ("/d/train/a/é.png", 0), ("/d/train/a/deep/2.jpg", 40000)]
    listed = FileList(pairs, prefix="/d/train/")
    assert list(listed) == pairs and len(listed) == 3 and listed[-1] == pairs[-1] and listed[0:3:2] == pairs[0:3:2]
    assert listed.targets.dtype == np.int64  # a class index above int16's range keeps its value
    assert FileList(pairs[:2]).targets.dtype == np.int16 and list(FileList(pairs[:2])) == pairs[:2]
    assert list(pickle.loads(pickle.dumps(listed))) == pairs  # a spawned or forkserver worker's copy
    assert len(FileList()) == 0 and list(FileList()) == []
    with pytest.raises(IndexError):
        listed[3]
    with pytest.raises(ValueError, match="does not start with the list's prefix"):
        FileList([("/elsewhere/x.JPEG", 0)], prefix="/d/train/")
    # The paths' bytes (after the prefix), a 4-byte end offset and a 2-byte class index each: nothing more.
    relative = [f"n{c:08d}/n{c:08d}_{i}.JPEG" for c in range(10) for i in range(1000)]
    imagenet_like = FileList(((f"/d/train/{path}", int(path[1:9])) for path in relative), prefix="/d/train/")
    assert imagenet_like.nbytes == sum(map(len, relative)) + (4 + 2) * 10_000


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux's per-process memory accounts")
def test_a_forked_worker_that_reads_every_sample_copies_no_page_of_the_file_list():
    from common.dataset_lists import FileList
    from common.measure import bytes_a_forked_reader_copies

    pairs = [(f"/datasets/imagenet/train/n{c:08d}/n{c:08d}_{i:05d}.JPEG", c) for c in range(100) for i in range(2000)]
    compact = FileList(pairs, prefix="/datasets/imagenet/train/")
    copied = {"tuples": bytes_a_forked_reader_copies(pairs), "compact": bytes_a_forked_reader_copies(compact)}
    assert copied["tuples"] > 10 * 2 ** 20, copied  # the copy-on-read the list avoids: this test can tell
    assert copied["compact"] < 2 ** 20, copied


# --- finding the lists once: the scan's cache, --file-list and its writer ---

def _found(root: Path, *flags) -> dataset_lists.DatasetLists:
    """What build_loaders would train on."""
    cfg = parse("nd", [str(root), *FAST_ARGS, *flags])
    return dataset_lists.find_lists(cfg.data, cfg.file_list, CPU)


def _source(lists) -> str:
    """SOURCE, of the last note: "file lists: N training and M validation images, SOURCE, in T s"."""
    return re.fullmatch(r"file lists: [\d,]+ training and [\d,]+ validation images, (.*), in [\d.]+ s",
                        lists.notes[-1]).group(1)


def test_a_scan_is_cached_and_used_again_until_a_folder_gains_loses_or_renames_a_file(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=2)
    first = _found(root)
    assert _source(first) == f"scanned, cached in {dataset_lists.cache_file(str(root))}"
    again = _found(root)
    assert _source(again) == f"from the cache {dataset_lists.cache_file(str(root))} (no folder changed since its scan)"
    assert list(again.train) == list(first.train) and list(again.val) == list(first.val)
    assert again.classes == first.classes == ["class_0", "class_1", "class_2"]
    folder = root / "train" / "class_1"
    changes = [lambda: (folder / "000.JPEG").rename(folder / "zzz.JPEG"),  # renamed
               lambda: (folder / "001.JPEG").unlink(),  # lost
               lambda: (folder / "sub").mkdir(),  # gained a folder, then a file in it
               lambda: (folder / "sub" / "new.JPEG").write_bytes((folder / "002.JPEG").read_bytes()),
               lambda: (root / "train" / "class_3").mkdir() or (folder / "003.JPEG").rename(
                   root / "train" / "class_3" / "003.JPEG")]  # a new class
    for change in changes:
        change()
        changed = _found(root)
        assert _source(changed).startswith("scanned"), changed.notes
        assert list(changed.train) == list(dataset_lists.scan_dataset(root).train)
        assert _source(_found(root)).startswith("from the cache")
    assert [Path(path).name for path, label in _found(root).train if label == 1] == ["002.JPEG", "zzz.JPEG",
                                                                                       "new.JPEG"]
    (root / "val" / "class_0" / "000.JPEG").unlink()  # val/ is checked too
    assert len(_found(root).val) == 5


def test_a_cache_that_cannot_be_read_is_scanned_again_and_one_that_cannot_be_written_is_said(tmp_path,
                                                                                                 monkeypatch):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    cache = dataset_lists.cache_file(str(root))
    _found(root)
    cache.write_bytes(cache.read_bytes()[:100])  # cut short
    assert _source(_found(root)).startswith("scanned, cached in")
    assert _source(_found(root)).startswith("from the cache")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    lists = _found(root)
    assert _source(lists).startswith(f"scanned; not cached ({blocked}/imagenet-reference/file-lists/data-")
    assert len(lists.train) == 4


def test_the_written_file_list_gives_the_scans_lists_back(tmp_path):
    from common.tools import filelist as tool

    root = make_image_folder(tmp_path / "data", classes=3, train_per_class=3, val_per_class=2)
    nested = root / "train" / "class_2" / "deeper"
    nested.mkdir()
    (nested / "a name with spaces.png").write_bytes((root / "train" / "class_2" / "000.JPEG").read_bytes())
    (root / "val" / "class_1").rename(root / "val" / "zzz")  # val's classes need not be all of train's...
    (root / "val" / "zzz").rename(root / "val" / "class_1")
    listed = tmp_path / "list.txt"
    tool.main([str(root), str(listed)])
    lines = listed.read_text().splitlines()
    assert lines[0] == "train/class_0/000.JPEG 0" and "train/class_2/deeper/a name with spaces.png 2" in lines
    assert len(lines) == 3 * 3 + 1 + 3 * 2
    scanned, read = dataset_lists.scan_dataset(root), _found(root, "--file-list", str(listed))
    assert (list(read.train), list(read.val), read.classes) == (list(scanned.train), list(scanned.val),
                                                                scanned.classes)
    assert _source(read) == f"from --file-list {listed}"
    with pytest.raises(UsageError, match=r"^OUT .*list.txt: exists; choose another name \(nothing is overwritten\)"):
        tool.main([str(root), str(listed)])


@pytest.mark.parametrize("lines, message", [
    (["train/class_0/000.JPEG 0", "val/class_0/000.JPEG"], r"line 2: expected 'train/<class>/<file> LABEL'"),
    (["test/class_0/000.JPEG 0"], r"line 1: expected"),
    (["train/class_0/000.JPEG zero"], r"line 1: expected"),
    (["train/000.JPEG 0"], r"line 1: expected"),  # no class folder
    (["train/class_0/000.JPEG 0", "train/class_1/000.JPEG 2", "val/class_0/000.JPEG 0"],
     r"train's labels must be 0 to K-1, each used; missing 1"),
    (["train/class_0/000.JPEG 0", "train/class_1/000.JPEG 0", "val/class_0/000.JPEG 0"],
     r"label 0 names 2 class folders under train/"),
    (["train/class_0/000.JPEG 0", "train/class_1/000.JPEG 1", "val/class_0/000.JPEG 1"],
     r"val/class_0/000.JPEG has label 1, but train/ gives 'class_0' label 0"),
    (["train/class_0/000.JPEG 0"], r"no val/ lines"),
    (["train/class_0/000.JPEG 0", "train/class_0/gone.JPEG 0", "val/class_0/000.JPEG 0", "val/class_0/x.JPEG 0"],
     r"2 listed file\(s\) missing, e.g. .*/train/class_0/gone.JPEG"),
])
def test_a_wrong_file_list_is_one_line_naming_it(tmp_path, lines, message):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError, match=rf"^argument --file-list: {listed}: {message}"):
        _found(root, "--file-list", str(listed))


def test_a_file_list_refuses_a_repeated_val_line_and_says_repeated_train_lines_once(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=2)
    listed = tmp_path / "list.txt"
    train = ["train/class_0/000.JPEG 0", "train/class_0/001.JPEG 0", "train/class_1/000.JPEG 1"]
    val = ["val/class_0/000.JPEG 0", "val/class_1/001.JPEG 1"]
    # Oversampling on purpose: two lines repeat line 1, one repeats line 3; each is trained on as listed.
    listed.write_text("\n".join(train + train[:1] + val + train[:1] + train[2:]) + "\n")
    lists = _found(root, "--file-list", str(listed))
    assert (len(lists.train), len(lists.val)) == (6, 2)
    assert [path[len(str(root)) + 1:] for path, _ in lists.train].count("train/class_0/000.JPEG") == 3
    assert lists.notes[:-1] == [f"note: --file-list {listed}: 3 training line(s) repeat an earlier line (the first: "
                                f"line 4, train/class_0/000.JPEG, as line 1): those images are trained on as often "
                                f"as they are listed"]
    assert _source(lists) == f"from --file-list {listed}"
    listed.write_text("\n".join(train + val + val + val[:1]) + "\n")  # a validation set of 2 images listed 5 times
    with pytest.raises(UsageError, match=rf"^argument --file-list: {listed}: line 6: val/class_0/000.JPEG is listed "
                                         rf"again \(first on line 4; 3 repeated val/ line\(s\) in all\): validation "
                                         rf"counts each image once; remove the repeats$"):
        _found(root, "--file-list", str(listed))


@pytest.mark.parametrize("path", ["val/class_0/./000.JPEG", "val/class_0//000.JPEG", "val/class_1/../class_0/000.JPEG",
                                  "train/class_0/sub/../000.JPEG"])
def test_a_file_list_path_must_name_its_file_plainly_so_a_repeat_cannot_hide(tmp_path, path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    (root / "train" / "class_0" / "sub").mkdir()
    listed = tmp_path / "list.txt"
    listed.write_text(f"train/class_0/000.JPEG 0\ntrain/class_1/000.JPEG 1\nval/class_0/000.JPEG 0\n{path} 0\n")
    with pytest.raises(UsageError, match=rf"^argument --file-list: {listed}: line 4: b'{re.escape(path)}' has an "
                                         rf"empty, '\.' or '\.\.' part; name each file plainly, as "
                                         rf"'{path.split('/')[0]}/<class>/<file>'$"):
        _found(root, "--file-list", str(listed))


def test_the_cache_sees_a_move_whose_folder_times_were_put_back(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    assert _source(_found(root)).startswith("scanned, cached in")
    source, destination = root / "train" / "class_1", root / "train" / "class_0"
    times = {folder: folder.stat() for folder in (source, destination)}
    # Changes made now get a later change time than the scan read: wait (without sleeping) for the file
    # system's clock, which may tick in milliseconds, to pass the newest one.
    probe = tmp_path / "probe"
    probe.touch()
    while probe.stat().st_ctime_ns <= max(status.st_ctime_ns for status in times.values()):
        os.utime(probe)
    (source / "001.JPEG").rename(destination / "moved.JPEG")
    for folder, status in times.items():  # as `touch -r` or a restore tool puts the times back
        os.utime(folder, ns=(status.st_atime_ns, status.st_mtime_ns))
        assert folder.stat().st_mtime_ns == status.st_mtime_ns
    lists = _found(root)
    assert _source(lists).startswith("scanned, cached in"), lists.notes
    assert [(Path(path).name, label) for path, label in lists.train] == [
        ("000.JPEG", 0), ("001.JPEG", 0), ("moved.JPEG", 0), ("000.JPEG", 1)]


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_rules_say(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    lists = _found(root)
    cache = tmp_path / "home" / ".cache" / "imagenet-reference" / "file-lists"
    assert _source(lists) == f"scanned, cached in {next(cache.glob('data-*.npz'))}"
    assert not (tmp_path / "relative-cache").exists()


@pytest.mark.parametrize("labels, message", [
    # One large label: the message's missing label is found in the lines' count of work (it once built a set
    # of every number up to the largest label: 10**15 of them, the machine's memory and more).
    (("0", "1000000000000000"), r"train's labels must be 0 to K-1, each used; missing 1$"),
    (("1", "999999999999999999"), r"train's labels must be 0 to K-1, each used; missing 0$"),
    # More digits than any class count: int() refuses 4,300 and more, with a traceback.
    (("0", "1" * 5000), r"line 2: label 111111111111111111111111\.\.\. has 5,000 digits; labels are class numbers"),
])
def test_a_huge_label_in_a_file_list_is_one_line_in_bounded_memory(tmp_path, labels, message):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    listed = tmp_path / "list.txt"
    listed.write_text(f"train/class_0/000.JPEG {labels[0]}\ntrain/class_1/000.JPEG {labels[1]}\n"
                      f"val/class_0/000.JPEG 0\n")
    with memory_capped(), pytest.raises(UsageError, match=rf"^argument --file-list: {listed}: {message}"):
        _found(root, "--file-list", str(listed))

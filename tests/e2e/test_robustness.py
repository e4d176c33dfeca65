"""Robustness end to end: datasets as they really are (--bad-images), a NaN
loss on one process, memory across epochs and room for the checkpoints.
(Host lists that try to inject shell commands: tests/e2e/test_run_scripts.py.)

The odd dataset holds every surprise at once: a PNG named .JPEG, CMYK,
grayscale, palette, RGBA and 16-bit images (all readable), zero-byte,
truncated, non-image, dangling-link and link-loop files (unreadable), files that are
not images at all (.DS_Store, notes, a FIFO), a symlinked class folder and a
val/ tree without one of train's classes. Exact numbers are checked: every
readable image is read once per epoch (by the bytes read), each unreadable
one is counted, listed and replaced by the next readable one.
"""
from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common import data, dataset_lists, image_files
from common.checkpoint import load
from common.rundir import CHECKPOINT_NAME, kept_checkpoints
from helpers import FAST_ARGS, REPO, csv_rows, make_image_folder, metrics_rows, needs_dali, run_script

IS_ROOT = os.geteuid() == 0


def _jpeg(path: Path, colour, size=24, mode="RGB", fmt="JPEG", seed=0) -> None:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).convert(mode).save(path, format=fmt)


def make_odd_dataset(root: Path) -> dict:
    """The tree described in the module docstring. Returns the readable and
    unreadable image files of each split (what the trainer must find)."""
    outside = root.parent / f"{root.name}-elsewhere"  # the target of the symlinked class folder
    readable = {"train": [], "val": []}
    unreadable = {"train": [], "val": []}
    for split, per_class in (("train", 5), ("val", 3)):
        for label in range(3):
            if split == "val" and label == 2:
                continue  # val/ lacks one of train's classes: allowed (its classes are a subset)
            folder = root / split / f"class_{label}"
            if split == "train" and label == 2:  # a class folder that is a symlink to another disk
                (outside / "class_2").mkdir(parents=True)
                folder.parent.mkdir(parents=True, exist_ok=True)
                folder.symlink_to(outside / "class_2", target_is_directory=True)
            folder.mkdir(parents=True, exist_ok=True)
            colour = [(60 + 80 * label) % 256, (200 - 70 * label) % 256, (40 * label) % 256]
            for index in range(per_class):
                path = folder / f"{index:03d}.JPEG"
                _jpeg(path, colour, seed=index + 10 * label)
                readable[split].append(path)
            # The real world's readable oddities.
            odd = {"png_named.JPEG": dict(fmt="PNG"), "cmyk.JPEG": dict(mode="CMYK"),
                   "gray.JPEG": dict(mode="L"), "rgba.png": dict(mode="RGBA", fmt="PNG"),
                   "palette.png": dict(mode="P", fmt="PNG")}
            for name, kwargs in odd.items():
                _jpeg(folder / f"{label}_{name}", colour, **kwargs)
                readable[split].append(folder / f"{label}_{name}")
            if split == "train" and label == 1:  # 44 training images in all: whole global batches of 2 and 4
                for extra in ("extra_a.JPEG", "extra_b.JPEG", "extra_c.JPEG", "extra_d.JPEG", "extra_e.JPEG"):
                    _jpeg(folder / extra, colour, seed=99)
                    readable[split].append(folder / extra)
            sixteen = folder / f"{label}_16bit.png"
            Image.fromarray(np.full((24, 24), 257 * colour[0], dtype=np.uint16)).save(sixteen)
            readable[split].append(sixteen)
            # Not images: ignored.
            (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
            (folder / "notes.txt").write_text("downloaded 2012\n")
            (folder / "._0_hidden.JPEG").write_bytes(b"AppleDouble")
            os.mkfifo(folder / "pipe.JPEG")  # a reader would block forever: must never be opened
        # Unreadable image files, in the first class folder of the split.
        folder = root / split / "class_0"
        empty, truncated, text, dangling = (folder / name for name in
                                            ("z_empty.JPEG", "z_truncated.JPEG", "z_text.jpg", "z_dangling.JPEG"))
        empty.write_bytes(b"")
        truncated.write_bytes(readable[split][0].read_bytes()[:150])
        text.write_text("<html>404 Not Found</html>")
        dangling.symlink_to(folder / "no-such-file.JPEG")
        loop = folder / "z_loop.JPEG"
        loop.symlink_to(loop)
        unreadable[split] += [empty, truncated, text, dangling, loop]
        locked = folder / "z_locked.JPEG"  # unreadable, except to root (who reads whatever the permissions)
        _jpeg(locked, (1, 2, 3))
        locked.chmod(0)
        (readable if IS_ROOT else unreadable)[split].append(locked)
    return {"readable": readable, "unreadable": unreadable}


@pytest.fixture
def odd_data(tmp_path):
    root = tmp_path / "odd"
    files = make_odd_dataset(root)
    return root, files


def _expected_bytes(root: Path, split: str, unreadable) -> int:
    """Bytes the split's pass reads: each readable file once, and for each
    unreadable one the next readable file after it in the scan order."""
    class_to_idx = None if split == "train" else {
        name: index for index, name in enumerate(dataset_lists.scan_split(root / "train")[0])}
    _, samples = dataset_lists.scan_split(root / split, class_to_idx)
    paths = [Path(path) for path, _ in samples]
    bad = set(unreadable)
    total = 0
    for index, path in enumerate(paths):
        if path in bad:
            path = next(paths[(index + offset) % len(paths)] for offset in range(1, len(paths))
                        if paths[(index + offset) % len(paths)] not in bad)
        total += path.stat().st_size
    return total


def _rows(run_dir: Path) -> dict:
    return {(int(row["epoch"]), row["split"]): row for row in metrics_rows(run_dir)}


def _listed(run_dir: Path) -> dict:
    return {Path(row["path"]): row for row in csv_rows(run_dir / "bad_images.csv")}


ODD_ARGS = ["-a", "resnet18", "--image-size", "16", "--val-resize", "16", "-p", "100", "--epochs", "1"]


def test_scan_finds_exactly_the_image_files(odd_data):
    root, files = odd_data
    classes, train = dataset_lists.scan_split(root / "train")
    assert classes == ["class_0", "class_1", "class_2"]
    assert sorted(Path(path) for path, _ in train) == sorted(files["readable"]["train"] +
                                                             files["unreadable"]["train"])
    _, val = dataset_lists.scan_split(root / "val", {name: index for index, name in enumerate(classes)})
    assert {target for _, target in val} == {0, 1}


def test_the_compact_file_list_holds_the_scan_in_order(odd_data):
    """scan_split's FileList gives back exactly the tuples the scan found:
    the paths (a name that is not UTF-8 too), their order and their classes."""
    root, _ = odd_data
    class_0 = root / "train" / "class_0"
    not_utf8 = os.fsdecode(os.fsencode(class_0) + b"/caf\xe9.JPEG")
    os.symlink(class_0 / "000.JPEG", not_utf8)
    class_to_idx = {f"class_{index}": index for index in range(3)}
    for split in ("train", "val"):
        _, listed = dataset_lists.scan_split(root / split, class_to_idx)
        found = [(path, index) for name, index in class_to_idx.items() if (root / split / name).exists()
                 for path in dataset_lists._image_files(root / split / name)]
        assert list(listed) == found and len(found) > 10
        assert [listed[index] for index in range(-len(found), 0)] == found  # negative indices, as a list's
        if split == "train":
            assert (not_utf8, 0) in found


def test_every_readable_oddity_decodes_to_its_colour(odd_data):
    root, files = odd_data
    for path in files["readable"]["train"]:
        image, file_bytes = image_files.read_rgb(str(path))
        assert image.mode == "RGB" and file_bytes == path.stat().st_size
        if path.name.endswith("16bit.png"):  # 16-bit values are scaled, not clipped to white
            label = int(path.parent.name[-1])
            assert image.getpixel((0, 0)) == ((60 + 80 * label) % 256,) * 3


BACKENDS = ["torchvision", pytest.param("dali", marks=needs_dali)]  # dali: the workers' checks, DALI's decode


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("script, procs", [("imagenet_nd.py", 1), ("imagenet_ddp.py", 2)])
def test_skip_counts_lists_and_replaces_every_unreadable_image(odd_data, tmp_path, script, procs, backend):
    root, files = odd_data
    # 44 training images: with -b 2 per process, one or two processes visit each of them once per epoch
    # (an epoch leaves out only an incomplete last global batch, and there is none).
    train_images = len(files["readable"]["train"]) + len(files["unreadable"]["train"])
    extra = ["--nproc-per-node", "2"] if procs == 2 else []
    result = run_script([script, root, *ODD_ARGS, "-b", "2", "-j", "1", "--bad-images", "skip", "--logdir",
                         tmp_path / "runs", "--run-name", "odd", "--data-backend", backend, *extra], timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "odd"
    rows = _rows(run_dir)
    bad_train, bad_val = files["unreadable"]["train"], files["unreadable"]["val"]
    train, val = rows[(0, "train")], rows[(0, "val")]
    assert train_images == 44
    assert (int(train["images"]), int(train["bad_images"])) == (train_images, len(bad_train))
    assert (int(val["images"]), int(val["bad_images"])) == (len(files["readable"]["val"]), len(bad_val))
    assert train_images % procs == 0
    assert int(train["dataset_bytes"]) == _expected_bytes(root, "train", bad_train)
    assert int(val["dataset_bytes"]) == _expected_bytes(root, "val", bad_val)
    listed = _listed(run_dir)
    assert set(listed) == set(bad_train) | set(bad_val)
    assert {listed[path]["split"] for path in bad_val} == {"val"}
    assert listed[bad_train[0]]["reason"] == "empty file"
    assert "No such file or directory" in listed[bad_train[3]]["reason"]  # the dangling link
    assert "Too many levels of symbolic links" in listed[bad_train[4]]["reason"]
    assert f"0 train: {len(bad_train)} unreadable image file(s) replaced by the next readable image" in result.stdout


def _first_unreadable_in_order(root: Path, unreadable, batch_size: int, seed: int = 0) -> Path:
    _, samples = dataset_lists.scan_split(root / "train")
    sampler = data.TrainSampler(len(samples), 0, 1, batch_size, seed)
    return next(Path(samples[index][0]) for index in sampler if Path(samples[index][0]) in set(unreadable))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fail_stops_at_the_first_unreadable_image_naming_it(odd_data, tmp_path, backend):
    root, files = odd_data
    result = run_script(["imagenet_nd.py", root, *ODD_ARGS, "-b", "2", "-j", "1", "--logdir", tmp_path / "runs",
                         "--data-backend", backend])
    first = _first_unreadable_in_order(root, files["unreadable"]["train"], batch_size=2)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"imagenet_nd.py: error: {first}: cannot decode image ("), lines
    assert lines[0].endswith("remove or replace the file, or pass --bad-images skip")


@pytest.mark.slow  # two or more training runs: CI runs it (make test-all)
def test_fail_under_two_processes_stops_the_job_without_a_hang(odd_data, tmp_path):
    root, files = odd_data
    started = time.monotonic()
    result = run_script(["imagenet_ddp.py", root, *ODD_ARGS, "-b", "2", "-j", "1", "--nproc-per-node", "2",
                         "--logdir", tmp_path / "runs"], timeout=240)
    assert time.monotonic() - started < 120  # far below --dist-timeout (300 s): no process waits for a dead peer
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    bad = {str(path) for path in files["unreadable"]["train"]}
    assert 1 <= len(lines) <= 2  # each process whose share meets an unreadable file says which
    for line in lines:
        assert line.startswith("imagenet_ddp.py: error: rank ") or line.startswith("imagenet_ddp.py: error: /")
        assert line.split(": cannot decode image")[0].split(": ")[-1] in bad


@pytest.mark.slow
def test_a_broken_class_folder_link_stops_the_run_naming_it(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    (root / "train" / "class_9").symlink_to(tmp_path / "unmounted" / "class_9")
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--logdir", tmp_path / "runs"])
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"imagenet_nd.py: error: {root / 'train' / 'class_9'}: class folder is a broken symbolic link "
        f"(to {tmp_path / 'unmounted' / 'class_9'})"]
    assert not (tmp_path / "runs").exists()


# --- a NaN loss on one process ---

# Loaded by every Python process of the job (PYTHONPATH): the loss of rank NAN_RANK's training steps
# listed in NAN_STEPS (counted from 0 over the run) becomes NaN; each process logs its training steps.
NAN_SITECUSTOMIZE = '''
import os
if "NAN_STEPS" in os.environ:
    import torch
    steps = {int(step) for step in os.environ["NAN_STEPS"].split(",")}
    original = torch.nn.CrossEntropyLoss.forward
    calls = [0]

    def bad_here():
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return rank == int(os.environ["NAN_RANK"]) and calls[0] in steps

    def forward(self, logits, target):
        loss = original(self, logits, target)
        if torch.is_grad_enabled():  # a training step (validation runs without gradients)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            with open(os.path.join(os.environ["NAN_LOG"], f"rank{rank}.steps"), "a") as log:
                log.write(f"{calls[0]}\\n")
            if bad_here() and os.environ.get("NAN_IN") == "loss":
                loss = loss * float("nan")
            calls[0] += 1
        return loss

    torch.nn.CrossEntropyLoss.forward = forward

    if os.environ.get("NAN_IN") == "images":  # the whole forward pass sees NaN: BatchNorm's statistics too
        import torchvision
        original_resnet = torchvision.models.ResNet.forward

        def resnet_forward(self, images):
            if torch.is_grad_enabled() and bad_here():
                images = images * float("nan")
            return original_resnet(self, images)

        torchvision.models.ResNet.forward = resnet_forward
'''


def _with_nan(tmp_path: Path, steps: str, rank: int, where: str = "loss") -> dict:
    hooks = tmp_path / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(NAN_SITECUSTOMIZE)
    log = tmp_path / "steps"
    log.mkdir(exist_ok=True)
    return {"PYTHONPATH": f"{hooks}{os.pathsep}{REPO}", "NAN_STEPS": steps, "NAN_RANK": str(rank), "NAN_LOG": str(log),
            "NAN_IN": where}


def _steps_taken(tmp_path: Path, rank: int) -> int:
    return len((tmp_path / "steps" / f"rank{rank}.steps").read_text().split())


@pytest.mark.slow  # two or more training runs: CI runs it (make test-all)
def test_a_nan_on_one_rank_stops_every_rank_at_that_step_keeping_the_last_good_checkpoint(tiny_data, tmp_path):
    # 24 images, global batch 2 x 2 = 4: 6 steps per epoch. The NaN comes at epoch 1 step 3 (step 9 overall),
    # after the checkpoint every 2 steps at epoch 1 step 2.
    result = run_script(["imagenet_ddp.py", tiny_data, *FAST_ARGS, "-b", "2", "--nproc-per-node", "2", "--epochs", "3",
                         "--checkpoint-every", "2steps", "--logdir", tmp_path / "runs", "--run-name", "nan"],
                        env_extra=_with_nan(tmp_path, steps="9", rank=1), timeout=300)
    assert result.returncode == 3, result.stderr
    run_dir = tmp_path / "runs" / "nan"
    good = run_dir / "checkpoint-epoch001-images00000008.pth.tar"  # epoch 1 after 2 steps of 4 images
    stop_lines = [line for line in result.stdout.splitlines() if line.startswith("stopping:")]
    assert stop_lines == [f"stopping: epoch 1 step 3: the training loss is NaN on 1 of 2 process(es) (lr 0.0015625); "
                          f"the weights since then are not saved and the last good checkpoint is {good} (continue "
                          f"from it with --resume and a lower --lr or more --warmup-epochs)"]
    assert result.stderr == ""  # the spawner adds nothing: the worker has said it
    # Both ranks stopped together: step 9 (epoch 1 step 3) is checked once step 10 is under way, here at
    # its start, before the checkpoint due there (every 2 steps), which is therefore never written.
    assert _steps_taken(tmp_path, 0) == _steps_taken(tmp_path, 1) == 10
    # Nothing written after the NaN; the newest checkpoint is the good one, and it loads, finite.
    assert kept_checkpoints(run_dir)[0] == good and os.path.samefile(run_dir / CHECKPOINT_NAME, good)
    state = load(str(good))
    assert (state["epoch"], state["step"]) == (1, 2)
    assert all(torch.isfinite(tensor).all() for tensor in state["state_dict"].values() if tensor.is_floating_point())


@pytest.mark.slow  # two or more training runs: CI runs it (make test-all)
def test_tolerated_nan_steps_are_skipped_and_one_more_stops_the_run(tiny_data, tmp_path):
    common = ["imagenet_nd.py", tiny_data, *FAST_ARGS, "--epochs", "1", "--logdir", tmp_path / "runs"]
    # NaN images: the forward pass also puts NaN into BatchNorm's running statistics, which the skip undoes.
    tolerated = run_script([*common, "--max-nonfinite-steps", "1", "--run-name", "one"],
                           env_extra=_with_nan(tmp_path, steps="2", rank=0, where="images"))
    assert tolerated.returncode == 0, tolerated.stderr
    assert ("warning: epoch 0 step 2: the training loss is not finite; step skipped (1 of --max-nonfinite-steps 1)"
            in tolerated.stdout.splitlines())
    train = _rows(tmp_path / "runs" / "one")[(0, "train")]
    assert int(train["images"]) == 24 - 4 and math.isfinite(float(train["loss"]))  # the skipped batch is left out
    weights = load(str(tmp_path / "runs" / "one" / CHECKPOINT_NAME))["state_dict"]
    assert any(name.endswith("running_mean") for name in weights)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values() if tensor.is_floating_point())
    val = _rows(tmp_path / "runs" / "one")[(0, "val")]
    assert math.isfinite(float(val["loss"]))

    too_many = run_script([*common, "--max-nonfinite-steps", "1", "--run-name", "two"],
                          env_extra=_with_nan(tmp_path / "second", steps="1,4", rank=0))
    assert too_many.returncode == 3
    assert ("stopping: epoch 0 step 4: the training loss is NaN on 1 of 1 process(es) (lr 0.0015625), more than "
            "--max-nonfinite-steps 1; no checkpoint was written before it (start again with a lower --lr or more "
            "--warmup-epochs)" in too_many.stdout.splitlines())


@pytest.mark.slow
def test_a_nan_in_the_last_step_of_an_epoch_stops_before_validation_and_its_checkpoint(tiny_data, tmp_path):
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "--epochs", "2", "--logdir", tmp_path / "runs",
                         "--run-name", "last"], env_extra=_with_nan(tmp_path, steps="5", rank=0))
    assert result.returncode == 3
    assert ("stopping: epoch 0 step 5: the training loss is NaN on 1 of 1 process(es) (lr 0.0015625); no checkpoint "
            "was written before it (start again with a lower --lr or more --warmup-epochs)" in result.stdout.splitlines())
    assert "epoch 0 val" not in result.stdout and kept_checkpoints(tmp_path / "runs" / "last") == []
    assert _steps_taken(tmp_path, 0) == 6  # no step of epoch 1


def test_the_loss_guard_in_one_process():
    from common.distributed import single_process
    from common.loss_guard import LossGuard, NonFiniteLoss

    guard = LossGuard(single_process("cpu"))
    assert guard.allows_update(torch.tensor(1.0), epoch=0, step=0, lr=0.1)
    assert guard.allows_update(torch.tensor(float("inf")), epoch=0, step=1, lr=0.1)  # seen one step later
    with pytest.raises(NonFiniteLoss, match=r"^epoch 0 step 1: the training loss is inf on 1 of 1 process\(es\) \(lr 0.1\)$"):
        guard.settle()
    guard.settle()  # nothing pending any more

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    tolerant = LossGuard(single_process("cpu"), tolerance=1)
    saved = tolerant.buffers_before(model)
    model.train()(torch.full((3, 2), float("nan")))  # a forward pass that poisons the running statistics
    assert not tolerant.allows_update(torch.tensor(float("nan")), epoch=1, step=0, lr=0.1)
    tolerant.restore_buffers(model, saved)
    assert torch.equal(model[1].running_mean, torch.zeros(2)) and int(model[1].num_batches_tracked) == 0
    assert LossGuard(single_process("cpu")).buffers_before(model) is None  # no copies without a tolerance

    tolerant.check_weights(model, "here")
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLoss, match="^here: 1 weight or buffer tensor"):
        tolerant.check_weights(model, "here")


# --- memory and room ---

# --data-timeout in the runs below: far above what a batch of 4 tiny images takes on a loaded 2-core machine
# (well under a second), so only the file that never reads meets it.
DATA_TIMEOUT = 10


def _a_file_that_never_reads(root: Path, split: str) -> tuple:
    """`root`'s first image of `split` in the order the run reads it (-b 4, seed 0, one process), made a
    FIFO that nobody writes to: opening it waits as a read on a file system that stopped answering does.
    The scan leaves FIFOs out, so the run gets the tree from a --file-list. Returns (FIFO, the list)."""
    lists = dataset_lists.scan_dataset(root)
    samples = lists.train if split == "train" else lists.val
    order = list(data.TrainSampler(len(samples), 0, 1, 4, 0)) if split == "train" else range(len(samples))
    # Training: the first image of step 2, so two steps are done before it; validation: its first image.
    fifo = Path(samples[order[8] if split == "train" else order[0]][0])
    list_path = root.parent / "files.txt"
    with open(list_path, "wb") as handle:
        dataset_lists.write_text_list(handle, lists)
    fifo.unlink()
    os.mkfifo(fifo)
    return fifo, list_path


@pytest.mark.slow  # a run waits out --data-timeout (10 s): CI runs it (make test-all)
@pytest.mark.parametrize("split, workers, where, images_done", [
    pytest.param("train", 1, "epoch 0 step 2/6", 8, id="training"),
    pytest.param("val", 1, "the end of epoch 0's training (step 6/6), in validation", 24, id="validation"),
    pytest.param("train", 0, None, None, id="workers-0"),
])
def test_a_file_that_never_reads_stops_the_run_naming_it_after_a_checkpoint_where_one_can_be_written(
        tiny_data, tmp_path, split, workers, where, images_done):
    fifo, list_path = _a_file_that_never_reads(tiny_data, split)
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "-j", workers, "--epochs", "2", "--file-list",
                         list_path, "--data-timeout", DATA_TIMEOUT, "--checkpoint-every", "0", "--logdir",
                         tmp_path / "runs", "--run-name", "R"], timeout=300)
    assert result.returncode == 5, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    run_dir = tmp_path / "runs" / "R"
    name = "training" if split == "train" else "validation"
    if workers:
        checkpoint = run_dir / f"checkpoint-epoch000-images{images_done:08d}.pth.tar"
        match = re.fullmatch(rf"imagenet_nd\.py: error: stopping at {re.escape(where)}: no {name} batch within "
                             rf"--data-timeout {DATA_TIMEOUT} s: data-loading worker 0 \(pid \d+\) has been reading "
                             rf"(.+) for (\d+) s; checkpoint saved to {re.escape(str(checkpoint))}; once the data reads "
                             rf"again, continue with --resume", lines[0])
        state = load(str(checkpoint))
        assert (state["epoch"], state["step"], state["images_done"]) == (0, images_done // 4, images_done)
    else:  # the training process itself waits in the read: it says so and ends, with no checkpoint
        match = re.fullmatch(rf"imagenet_nd\.py: error: no {name} batch within --data-timeout {DATA_TIMEOUT} s: the "
                             rf"training process itself \(--workers 0\) has been reading (.+) for (\d+) s; the read "
                             rf"holds it, so it ends without a checkpoint \(--resume continues from the newest; with "
                             rf"--workers 1 or more, a stall stops at a checkpoint\)", lines[0])
        assert kept_checkpoints(run_dir) == [] and not (run_dir / CHECKPOINT_NAME).exists()
    assert match and match.group(1) == str(fifo) and int(match.group(2)) >= DATA_TIMEOUT, lines[0]


@pytest.mark.slow  # two or more training runs: CI runs it (make test-all)
def test_resident_memory_does_not_grow_across_epochs(tiny_data, tmp_path):
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "-j", "2", "--epochs", "4", "--logdir",
                         tmp_path / "runs", "--run-name", "memory"])
    assert result.returncode == 0, result.stderr
    rows = _rows(tmp_path / "runs" / "memory")
    after = {epoch: float(rows[(epoch, "val")]["host_memory_mib"]) for epoch in range(4)}
    assert after[1] > 50  # a real measurement (a Python process with torch holds far more)
    assert after[3] <= 1.10 * after[1], after


@pytest.mark.slow
def test_a_log_directory_without_room_for_the_checkpoints_is_refused_before_training(tiny_data, tmp_path):
    logdir = tmp_path / "runs"
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "--logdir", logdir, "--run-name", "huge",
                         "--keep-checkpoints", "100000000"])
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("imagenet_nd.py: error: argument --logdir: ")
    assert "with --keep-checkpoints 100000000" in lines[0] and "epoch 0" not in result.stdout
    assert not (logdir / "huge").exists()  # the new run's directory is not left behind


@pytest.mark.skipif(IS_ROOT, reason="root writes whatever the permissions")
def test_a_read_only_run_directory_is_refused_and_left_as_it_was(tiny_data, tmp_path):
    logdir = tmp_path / "runs"
    (logdir / "taken").mkdir(parents=True)
    (logdir / "taken").chmod(0o555)
    result = run_script(["imagenet_nd.py", tiny_data, *FAST_ARGS, "--logdir", logdir, "--resume", "auto",
                         "--run-name", "taken"])
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (f"imagenet_nd.py: error: argument --logdir: cannot write in "
                                              f"{logdir / 'taken'} (permission denied)")

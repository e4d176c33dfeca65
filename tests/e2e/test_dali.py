"""--data-backend dali (common.dali), on the CPU where DALI runs its CPU
decoder, and on a GPU (`gpu` marker): each process gets the torchvision
backend's images in its order (whole epochs, resumed half epochs, one and
two processes), DALI cuts the same crops within a few gray levels, a file
DALI refuses costs a warning, not the run, and a missing DALI is one line.
The --bad-images tests with DALI are in test_robustness.py."""
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common import cli, dali, data, device_input, image_files
from common.distributed import single_process
from common.device_input import EncodedBatch
from common.pipelines import DaliImages, Geometry, TensorImages
from common.tools.demo_data import write_fake_imagenet
from helpers import ENV, REPO, load_checkpoint, make_image_folder, metrics_rows, needs_dali, run_script, weights

COLOUR_STEP = 8  # gray levels between the colours that number the images: JPEG keeps a flat colour within 2


def numbered_tree(root: Path, classes: int = 3, train_per_class: int = 10, val_per_class: int = 3) -> Path:
    """A tree whose every image is one flat colour that says its number
    (numbering train/ and val/ apart, in scan order): whatever crop and flip
    a backend makes, the image it delivers can be told by its mean colour."""
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True)
            for index in range(per_class):
                number = label * per_class + index
                colour = (4 + COLOUR_STEP * (number % 32), 4 + COLOUR_STEP * (number // 32), 128)
                Image.new("RGB", (40 + 3 * index, 30 + 2 * label), colour).save(folder / f"{index:02d}.JPEG",
                                                                                 quality=95)
    return root


def image_numbers(images: torch.Tensor) -> list:
    """The number each uint8 image of a batch shows (numbered_tree)."""
    mean = images.double().mean(dim=(2, 3))
    levels = ((mean[:, :2] - 4) / COLOUR_STEP).round().long()
    return (levels[:, 0] + 32 * levels[:, 1]).tolist()


def uint8_batches(loaders: data.Loaders, loader) -> list:
    """The uint8 images of each batch of `loader`, on the CPU, as the device would get them."""
    for batch in loader:
        image = batch.image
        yield image.decode(torch.device("cpu"), loaders.dali) if isinstance(image, EncodedBatch) else image, batch


def seen(loaders: data.Loaders, loader) -> list:
    """(image number, class index) of every sample `loader` yields, in order."""
    pairs = []
    for images, batch in uint8_batches(loaders, loader):
        assert images.shape[1:] == (3, 24, 24) and images.dtype == torch.uint8
        pairs += list(zip(image_numbers(images), batch.target.tolist()))
    return pairs


def loaders_for(root: Path, backend: str, rank: int, world_size: int) -> data.Loaders:
    cfg = cli.parse("nd", [str(root), "-b", "3", "-j", "1", "--image-size", "24", "--val-resize", "28",
                           "--data-backend", backend])
    ctx = dataclasses.replace(single_process("cpu"), rank=rank, world_size=world_size)
    return data.build_loaders(cfg, ctx)


@needs_dali
@pytest.mark.parametrize("world_size", [1, 2])
def test_each_process_gets_the_torchvision_backends_images_in_its_order(tmp_path, world_size):
    root = numbered_tree(tmp_path / "numbered")
    for rank in range(world_size):
        orders = {}
        for backend in ("torchvision", "dali"):
            loaders = loaders_for(root, backend, rank, world_size)
            assert (loaders.dali is not None) == (backend == "dali")
            loaders.set_epoch(1)
            whole = seen(loaders, loaders.train)
            half = 3 * world_size * 2  # two global batches of the epoch's five (30 images, 3 per process)
            loaders.set_epoch(1, images_done=half)
            resumed = seen(loaders, loaders.train)
            orders[backend] = whole, resumed, seen(loaders, loaders.val)
        (whole, resumed, val) = orders["dali"]
        assert orders["dali"] == orders["torchvision"]
        # ... and that order is this process's share of the sampler's: positions rank, rank + W, ... of
        # the epoch's permutation, and after a resume the rest of them.
        loaders.set_epoch(1)
        expected = [index for index in loaders.train.sampler]
        assert [number for number, _ in whole] == expected and len(whole) == 30 // world_size
        assert resumed == whole[len(whole) - len(resumed):] and len(resumed) == len(whole) - half // world_size
        assert [number for number, _ in val] == list(range(rank, 9, world_size))  # every image once overall
        assert all(target == number // 10 for number, target in whole) and all(
            target == number // 3 for number, target in val)


def dali_threads() -> list:
    """The names of this process's threads that DALI started (it names each "[DALI]...")."""
    names = (_thread_name(task) for task in os.listdir("/proc/self/task"))
    return sorted(name for name in names if name.startswith("[DALI]"))


def _thread_name(task: str) -> str:
    """A thread's name; "" for one that ended since /proc/self/task was listed (it runs no more: a
    thread of the torch or DALI pools ending between the two reads once failed this test)."""
    try:
        return Path(f"/proc/self/task/{task}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


@pytest.fixture
def threads_at_fork(monkeypatch) -> list:
    """DALI's threads (dali_threads) at each os.fork of this test, in turn."""
    seen_at_fork = []
    real_fork = os.fork

    def recording_fork():
        seen_at_fork.append(dali_threads())
        return real_fork()

    monkeypatch.setattr(os, "fork", recording_fork)
    return seen_at_fork


@needs_dali
def test_no_data_loading_worker_is_forked_while_dalis_threads_run(tmp_path, threads_at_fork):
    """A forked child has only the forking thread: a lock one of DALI's
    threads held at that instant would stay held in the data-loading worker
    for good (a run hung that way once in CI, its batch never coming). So the
    training process ends DALI's threads before each fork, and DALI builds
    its pipeline again at the next decode, which decodes as before."""
    root = numbered_tree(tmp_path / "numbered")
    loaders = loaders_for(root, "dali", rank=0, world_size=1)
    loaders.set_epoch(0)
    first_epoch = seen(loaders, loaders.train)
    assert dali_threads(), "DALI's pipeline decoded with no thread of its own: nothing checked here"
    val = seen(loaders, loaders.val)  # its worker is forked after DALI decoded the training batches
    loaders.set_epoch(0)
    assert seen(loaders, loaders.train) == first_epoch  # a new pipeline, the same images in the same order
    assert threads_at_fork == [[], [], []]  # -j 1: one worker per pass, three passes, none beside DALI's threads
    assert [number for number, _ in val] == list(range(9)) and len(first_epoch) == 30


@needs_dali
def test_dali_runs_ahead_of_the_step_with_the_images_and_order_of_one_batch_at_a_time(tmp_path):
    """DeviceInput puts DaliDecoder.ahead between the loader and the step:
    when the step gets batch n, the JPEGs of batch n + 1 (n + D - 1 at depth
    D) are already fed to DALI and their decode scheduled in its threads; the
    images are exactly those of decoding one batch at a time, in their order,
    for a whole epoch, a resumed half epoch and validation."""
    root = numbered_tree(tmp_path / "numbered")
    loaders = loaders_for(root, "dali", rank=0, world_size=1)
    decoder = loaders.dali
    assert decoder.ahead_batches == dali.AHEAD_BATCHES == 2 and decoder.to_dict()["ahead_batches"] == 2

    def one_at_a_time(split: str) -> list:
        return [device_input.normalize(batch.image.decode(torch.device("cpu"), decoder))
                for batch in loaders.batches(split)]

    def run_ahead(split: str, depth: int) -> tuple:
        decoder.ahead_batches = depth
        fed_before, fed_when_taken = decoder.batches_fed, []
        decode = decoder.decode

        def counting_decode(batch):  # the batches DALI was given when this one's images are taken
            fed_when_taken.append(decoder.batches_fed - fed_before)
            return decode(batch)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decoder, "decode", counting_decode)
            images = [batch.image for batch in device_input.DeviceInput(torch.device("cpu"))(
                loaders.batches(split), decoder)]
        return images, fed_when_taken

    for images_done in (0, 6):  # a whole epoch (10 batches of 3), and one resumed after two batches
        loaders.set_epoch(1, images_done=images_done)
        reference = one_at_a_time("train")
        assert len(reference) == 10 - images_done // 3
        for depth in (2, 3):
            loaders.set_epoch(1, images_done=images_done)
            images, fed = run_ahead("train", depth)
            assert len(images) == len(reference) and all(torch.equal(a, b) for a, b in zip(images, reference))
            assert fed == [min(index + depth, len(reference)) for index in range(len(reference))]
    reference = one_at_a_time("val")
    images, fed = run_ahead("val", 2)
    assert all(torch.equal(a, b) for a, b in zip(images, reference)) and len(images) == 3 and fed == [2, 3, 3]


@needs_dali
def test_a_batch_dali_refuses_while_others_are_in_flight_leaves_them_in_their_order(tmp_path, monkeypatch):
    """The batches fed after one DALI refuses went to a pipeline that is
    unusable now: a new one is fed them again, and they come out as decoded
    one at a time, after the refused batch's CPU decode and one warning."""
    good = [tmp_path / f"good{index}.JPEG" for index in range(6)]
    for index, path in enumerate(good):
        path.write_bytes(_jpeg_bytes(seed=index))
    bad = tmp_path / "bad.JPEG"
    bad.write_bytes(_damaged_inside(_jpeg_bytes()))
    pipeline = DaliImages(True, 16)
    files = [[good[0], good[1]], [good[2], bad], [good[3], good[4]], [good[5], good[0]]]
    batches = [data.Sample(encoded_batch([str(path) for path in paths], pipeline, seed=10 * index), None, None)
               for index, paths in enumerate(files)]
    stand_in = torch.zeros(3, 16, 16, dtype=torch.uint8)  # what the CPU's decode gives the refused batch here
    monkeypatch.setattr(batches[1].image, "decode_jpegs", lambda device: [stand_in, stand_in])
    one_at_a_time = dali.DaliDecoder(torch.device("cpu"), max_batch=2, threads=1)
    expected = [batch.image.decode(torch.device("cpu"), one_at_a_time) for batch in (batches[0], *batches[2:])]
    decoder = dali.DaliDecoder(torch.device("cpu"), max_batch=2, threads=1, ahead=3)
    got = []
    with pytest.warns(device_input.GPUDecodeFallback, match="DALI refused a batch") as warned:
        for sample in decoder.ahead(iter(batches)):
            got.append(sample.image.decode(torch.device("cpu"), decoder))
    assert len(warned) == 1 and decoder.refused_in_a_row == 0
    assert torch.equal(got[1], torch.stack([stand_in, stand_in]))
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip([got[0], *got[2:]], expected))
    assert decoder.batches_fed == 4 + 2  # the two fed after the refused one, fed again


@needs_dali
def test_no_dali_thread_outlives_a_pass_left_early_nor_runs_at_a_fork(tmp_path, threads_at_fork):
    """A training pass left with batches in flight (a stop, an error) drops
    them and the pipeline's threads once its iterator is closed; one that is
    not closed still has them ended before the next pass forks its worker.
    Either way the next pass gets every image, in order."""
    root = numbered_tree(tmp_path / "numbered")
    loaders = loaders_for(root, "dali", rank=0, world_size=1)
    decoder = loaders.dali
    loaders.set_epoch(0)
    left = decoder.ahead(loaders.batches("train"))
    first = next(left)
    first.image.decode(torch.device("cpu"), decoder)
    assert dali_threads() and decoder.batches_fed == 2, "nothing in flight: nothing checked here"
    assert decoder.batches_in_flight == 1
    left.close()
    assert dali_threads() == [] and decoder.batches_fed == 2 and decoder.batches_in_flight == 0
    held = decoder.ahead(loaders.batches("train"))  # left open, a batch in flight, while validation forks
    next(held).image.decode(torch.device("cpu"), decoder)
    assert dali_threads()
    val = [number for images, _ in _decoded(decoder, loaders.batches("val")) for number in image_numbers(images)]
    assert val == list(range(9))
    loaders.set_epoch(0)
    train = [number for images, _ in _decoded(decoder, loaders.batches("train")) for number in image_numbers(images)]
    assert train == list(loaders.train.sampler) and len(train) == 30
    assert threads_at_fork == [[], [], [], []]  # -j 1: one worker for each of the four passes


@needs_dali
def test_a_pass_after_one_left_open_feeds_each_of_its_batches_once_more_at_most(tmp_path):
    """Batches a pass left in flight (its iterator not closed yet) are
    dropped when the next pass takes its first batch, but only they: that
    pass's own batches fed ahead stay in flight, so it is not left feeding
    every later batch twice (building a pipeline for each). And the pass
    left open, closed while another runs, drops only its own."""
    root = numbered_tree(tmp_path / "numbered")
    loaders = loaders_for(root, "dali", rank=0, world_size=1)
    decoder = loaders.dali
    loaders.set_epoch(0)
    held = decoder.ahead(loaders.batches("train"))
    next(held).image.decode(torch.device("cpu"), decoder)
    assert decoder.batches_in_flight == 1, "nothing left in flight: nothing checked here"
    fed_before = decoder.batches_fed
    loaders.set_epoch(0)
    train = [number for images, _ in _decoded(decoder, loaders.batches("train")) for number in image_numbers(images)]
    assert train == list(loaders.train.sampler) and len(train) == 30
    # 10 batches; the held one fed again to the pipeline built after the fork, and batches 1 and 2 fed again
    # to the one built once it was dropped (the next pass at depth 2 has fed them by then).
    assert decoder.batches_fed - fed_before == 10 + 1 + 2 and decoder.batches_in_flight == 0
    held.close()
    held = decoder.ahead(loaders.batches("train"))
    next(held).image.decode(torch.device("cpu"), decoder)
    fed_before = decoder.batches_fed
    running = decoder.ahead(loaders.batches("val"))
    first = next(running)  # validation's batches 1 and 2 fed after the held pass's batch
    assert decoder.batches_in_flight == 3
    held.close()  # drops its own batch: validation's two are fed again to a new pipeline, and kept
    val = [first.image.decode(torch.device("cpu"), decoder)] + [
        sample.image.decode(torch.device("cpu"), decoder) for sample in running]
    assert [number for images in val for number in image_numbers(images)] == list(range(9))
    # 3 batches; the held one fed again after the fork, validation's first two fed again after it was dropped.
    assert decoder.batches_fed - fed_before == 3 + 1 + 2 and decoder.batches_in_flight == 0


def _decoded(decoder, batches):
    for batch in decoder.ahead(batches):
        yield batch.image.decode(torch.device("cpu"), decoder), batch


def test_validation_windows_are_torchvisions_resize_and_centre_crop():
    """The region DALI resizes to S x S is the one that resizing the short
    side to val_resize and cutting the centre S x S keeps (torchvision's
    rounding: the long side truncated, the offsets rounded)."""
    geometry = Geometry(224, val_resize=256)
    box, region = dali.windows(geometry, 500, 375)  # resized to 341 x 256: offsets 16 (rows) and 58 (columns)
    assert box == [0, 0, 500, 375]
    assert region == pytest.approx([16 * 375 / 256, 58 * 500 / 341, 240 * 375 / 256, 282 * 500 / 341])
    box, region = dali.windows(geometry, 375, 500)  # portrait: 256 x 341
    assert region == pytest.approx([58 * 500 / 341, 16 * 375 / 256, 282 * 500 / 341, 240 * 375 / 256])
    _, region = dali.windows(Geometry(224, val_resize=224), 224, 224)  # nothing to resize, nothing to cut
    assert region == pytest.approx([0, 0, 224, 224])
    crop = Geometry(64, crop=(10, 20, 30, 40), flip=True)  # training: (top, left, height, width), all of it
    assert dali.windows(crop, 500, 375) == ([20, 10, 40, 30], [0.0, 0.0, 30, 40])


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> list:
    """ImageNet-shaped JPEGs, a grayscale and a progressive JPEG (DALI's),
    and a CMYK JPEG and a PNG (finished in the worker)."""
    root = tmp_path_factory.mktemp("fake") / "tree"
    write_fake_imagenet(root, classes=1, train_per_class=8, val_per_class=1)
    paths = sorted(str(path) for path in (root / "train").rglob("*.JPEG"))
    source = Image.open(paths[0]).convert("RGB")
    source.convert("L").save(root / "gray.jpg", quality=90)
    source.save(root / "progressive.jpg", quality=90, progressive=True)
    source.convert("CMYK").save(root / "cmyk.jpg", quality=90)
    source.save(root / "image.png")
    return paths + [str(root / name) for name in ("gray.jpg", "progressive.jpg", "cmyk.jpg", "image.png")]


def encoded_batch(paths, pipeline, seed: int = 0) -> EncodedBatch:
    samples = []
    for offset, path in enumerate(paths):
        torch.manual_seed(seed + offset)  # the crop and flip draws of the image, as its dataset seeds them
        encoded, file_bytes, _ = pipeline(path)
        samples.append(data.Sample(encoded, 0, file_bytes))
    return data.collate(samples).image


def torchvision_images(paths, train: bool, size: int, seed: int = 0) -> torch.Tensor:
    fast = TensorImages(train, size, val_resize=256, reduced_decode=False)
    images = []
    for offset, path in enumerate(paths):
        torch.manual_seed(seed + offset)
        images.append(fast(path)[0])
    return torch.stack(images)


@needs_dali
@pytest.mark.parametrize("train, size, most", [(True, 224, 4), (False, 224, 2), (True, 64, 4)],
                         ids=["train-224", "val-224", "train-64"])
def test_dali_cuts_the_torchvision_backends_crops_within_a_few_gray_levels(jpegs, train, size, most):
    """The same boxes and flips (the project's draws), decoded by DALI: only
    the resampling differs (measured: at most 3 levels, means below 0.2, on
    the CPU decoder); a box off by a pixel would differ by tens of levels."""
    # Full-size decoding in the workers too (the CMYK file), as torchvision_images does.
    batch = encoded_batch(jpegs, DaliImages(train, size, val_resize=256, reduced_decode=False))
    assert batch.is_jpeg == [True] * (len(jpegs) - 2) + [False, False]  # CMYK and PNG: finished in the worker
    decoder = dali.DaliDecoder(torch.device("cpu"), max_batch=len(jpegs), threads=2)
    got = batch.decode(torch.device("cpu"), decoder)
    expected = torchvision_images(jpegs, train, size)
    assert got.shape == expected.shape == (len(jpegs), 3, size, size) and got.dtype == torch.uint8
    assert got.is_contiguous(memory_format=torch.channels_last)  # as every uint8 batch reaches DeviceInput
    difference = (got.int() - expected.int()).abs().double()
    assert difference.amax().item() <= most, difference.amax(dim=(1, 2, 3)).tolist()
    assert difference.mean(dim=(1, 2, 3)).max().item() <= 0.3
    assert torch.equal(got[-2:], expected[-2:])  # the worker's own images pass through untouched


def _jpeg_bytes(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _damaged_inside(encoded: bytes) -> bytes:
    """A JPEG whose header and end marker are whole (the workers' checks
    pass it on) but whose frame says 3 components and the scan 2."""
    scan = encoded.index(b"\xff\xda")
    return encoded[:scan + 4] + bytes([2]) + encoded[scan + 5:]


@needs_dali
def test_a_file_dali_refuses_costs_one_warning_and_a_cpu_decode_not_the_run(tmp_path):
    good = _jpeg_bytes()
    bad = tmp_path / "bad.JPEG"
    bad.write_bytes(_damaged_inside(good))
    files = [tmp_path / f"good{index}.JPEG" for index in range(2)]
    for path in files:
        path.write_bytes(good)
    pipeline = DaliImages(True, 16)
    decoder = dali.DaliDecoder(torch.device("cpu"), max_batch=3, threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        healthy = encoded_batch([str(path) for path in files], pipeline).decode(torch.device("cpu"), decoder)
    refused = encoded_batch([str(files[0]), str(bad)], pipeline)
    assert refused.is_jpeg == [True, True]  # nothing the workers could see
    with pytest.warns(device_input.GPUDecodeFallback, match="DALI refused a batch"), \
            pytest.raises(image_files.BadImageError, match=r"bad\.JPEG: cannot decode image .*too late for --bad-imag"):
        refused.decode(torch.device("cpu"), decoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new pipeline, and no second warning
        assert torch.equal(encoded_batch([str(path) for path in files], pipeline).decode(torch.device("cpu"),
                                                                                         decoder), healthy)
    # Batch after batch refused is DALI failing here, not a file: the run stops, naming the backend.
    only_damaged = encoded_batch([str(bad)], DaliImages(True, 16), seed=5)
    for _ in range(dali.MAX_REFUSED_IN_A_ROW - 1):
        with warnings.catch_warnings(), pytest.raises(image_files.BadImageError):
            warnings.simplefilter("ignore")
            only_damaged.decode(torch.device("cpu"), decoder)
    with pytest.raises(dali.DaliFailing, match=f"^argument --data-backend: DALI refused "
                                               f"{dali.MAX_REFUSED_IN_A_ROW} batches in a row"):
        only_damaged.decode(torch.device("cpu"), decoder)


def test_without_dali_the_backend_is_one_line_naming_the_package(tmp_path):
    """nvidia.dali made unimportable in the script's own process (whether or
    not it is installed here): exit 2 and one line before any data is read."""
    tree = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    hide_dali = ("import runpy, sys; sys.modules['nvidia.dali'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
    completed = subprocess.run([sys.executable, "-c", hide_dali, "imagenet_nd.py", str(tree), "--data-backend",
                                "dali", "--logdir", str(tmp_path / "runs")], cwd=REPO, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 2, completed.stderr
    package = dali.dali_package()
    assert package == (f"nvidia-dali-cuda{torch.version.cuda.split('.')[0]}0" if torch.version.cuda
                       else "nvidia-dali-cuda130")
    assert completed.stderr.splitlines() == [
        f"imagenet_nd.py: error: argument --data-backend: dali needs NVIDIA DALI (not installed): pip install "
        f"'{package}>=2.4'{dali_cuda_words()} (pip install -r requirements-dali.txt for CUDA 13)"]
    assert not (tmp_path / "runs").exists()


def dali_cuda_words() -> str:
    return f" for this PyTorch's CUDA {torch.version.cuda}" if torch.version.cuda else ""


# --- end to end: two processes, a mid-epoch resume, the same counts as the torchvision backend ---

RUN = ["-a", "squeezenet1_1", "--dropout", "0", "--image-size", "32", "--val-resize", "36", "-b", "4", "-j", "1",
       "--nproc-per-node", "2", "--epochs", "2", "-p", "1"]


@needs_dali
@pytest.mark.slow
def test_two_processes_train_with_dali_and_a_mid_epoch_resume_equals_the_whole_run(tmp_path):
    tree = make_image_folder(tmp_path / "data", classes=3, train_per_class=8, val_per_class=3, size=48)
    whole = run_script([REPO / "imagenet_ddp.py", tree, *RUN, "--data-backend", "dali", "--checkpoint-every",
                        "2steps", "--keep-checkpoints", "5", "--logdir", tmp_path / "whole", "--run-name", "r"],
                       env_extra=ENV)
    assert whole.returncode == 0, whole.stderr
    assert f"DALI {dali.import_dali().__version__} decodes the JPEGs on the CPU" in whole.stdout
    run_dir = tmp_path / "whole" / "r"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["dali"]["device"] == "cpu"
    reference = run_script([REPO / "imagenet_ddp.py", tree, *RUN, "--logdir", tmp_path / "tv", "--run-name", "r"],
                           env_extra=ENV)
    assert reference.returncode == 0, reference.stderr
    counted = ["epoch", "split", "images", "steps", "dataset_bytes"]
    # 24 training images: 3 global batches of 8 an epoch; 9 validation images, each counted once.
    assert [[row[key] for key in counted] for row in metrics_rows(run_dir)] == \
        [[row[key] for key in counted] for row in metrics_rows(tmp_path / "tv" / "r")]
    assert [(row["split"], row["images"]) for row in metrics_rows(run_dir)] == [("train", "24"), ("val", "9")] * 2

    kept = tmp_path / "kept"
    shutil.copytree(run_dir, kept)
    mid_epoch = run_dir / "checkpoint-epoch001-images00000008.pth.tar"  # a checkpoint every 2 of the 6 steps
    assert load_checkpoint(mid_epoch)["images_done"] == 8
    resumed = run_script([REPO / "imagenet_ddp.py", tree, *RUN, "--data-backend", "dali", "--resume", mid_epoch],
                         env_extra=ENV)
    assert resumed.returncode == 0, resumed.stderr
    ours, theirs = weights(run_dir), weights(kept)
    # DALI cuts the run's own crops, so the resumed half epoch trains on the same pixels.
    assert max((ours[key].double() - theirs[key].double()).abs().max().item() for key in theirs) <= 1e-6
    same = ["epoch", "split", "loss", "top1", "top5", "images", "steps"]
    assert [[row[key] for key in same] for row in metrics_rows(run_dir)] == \
        [[row[key] for key in same] for row in metrics_rows(kept)]


# --- on a GPU: the hardware decoder / nvJPEG path ---

@needs_dali
@pytest.mark.gpu
def test_the_gpu_decodes_the_cpu_decoders_crops_within_a_few_gray_levels(jpegs):
    batch = encoded_batch(jpegs, DaliImages(True, 224))
    with warnings.catch_warnings():
        warnings.simplefilter("error", device_input.GPUDecodeFallback)  # DALI's GPU decode, not the CPU's stand-in
        on_gpu = batch.decode(torch.device("cuda"),
                              dali.DaliDecoder(torch.device("cuda"), len(jpegs), 4, libjpeg_chroma=True))
    on_cpu = batch.decode(torch.device("cpu"), dali.DaliDecoder(torch.device("cpu"), len(jpegs), 2))
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    difference = (on_gpu.cpu().int() - on_cpu.int()).abs().double()
    # nvJPEG and the hardware decoder use their own IDCTs (the chroma upsampling is set to libjpeg's here; a
    # run's default, the hardware decoder's own, is what test_a_gpu_run_with_dali_trains_and_counts_every_image runs).
    assert difference.mean(dim=(1, 2, 3)).max().item() <= 1.0 and difference.amax().item() <= 16


@needs_dali
@pytest.mark.gpu
def test_a_gpu_run_with_dali_trains_and_counts_every_image(tmp_path):
    tree = make_image_folder(tmp_path / "data", classes=3, train_per_class=16, val_per_class=5, size=64)
    result = run_script([REPO / "imagenet_nd.py", tree, "-a", "resnet18", "--image-size", "32", "--val-resize", "36",
                         "-b", "8", "-j", "2", "--epochs", "1", "--data-backend", "dali", "--logdir", tmp_path / "runs",
                         "--run-name", "r"], env_extra={"CUDA_VISIBLE_DEVICES": "0"}, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "decodes the JPEGs on the GPU" in result.stdout and "DALI refused" not in result.stderr
    assert [(row["split"], row["images"]) for row in metrics_rows(tmp_path / "runs" / "r")] == [("train", "48"),
                                                                                                 ("val", "15")]


@needs_dali
@pytest.mark.gpu
def test_on_the_gpu_dali_ahead_of_the_step_gives_the_batches_of_one_at_a_time(tmp_path):
    """The mixed decoder with batches in flight (DeviceInput's side stream
    taking each, AHEAD_BATCHES fed ahead): every batch equals the one decoded
    alone on the GPU, in order, with nothing left in flight at the end."""
    root = numbered_tree(tmp_path / "numbered")
    cfg = cli.parse("nd", [str(root), "-b", "3", "-j", "1", "--image-size", "24", "--val-resize", "28",
                           "--data-backend", "dali"])
    loaders = data.build_loaders(cfg, single_process("cuda"))
    decoder, cuda = loaders.dali, torch.device("cuda")
    assert decoder.on_gpu and decoder.ahead_batches == 2
    loaders.set_epoch(1)
    reference = [device_input.normalize(batch.image.decode(cuda, decoder)) for batch in loaders.batches("train")]
    loaders.set_epoch(1)
    fed_before = decoder.batches_fed
    with warnings.catch_warnings():
        warnings.simplefilter("error", device_input.GPUDecodeFallback)
        got = [batch.image for batch in device_input.DeviceInput(cuda)(loaders.batches("train"), decoder)]
    torch.cuda.synchronize()
    assert len(got) == len(reference) == 10 and all(torch.equal(a, b) for a, b in zip(got, reference))
    assert decoder.batches_fed - fed_before == 10 and decoder.batches_in_flight == 0

"""The image pipelines of --data-backend: the fast paths cut the same crops
as the Pillow reference for the same random parameters, call the same files
unreadable, and hand the model the same normalised numbers; the device stage,
the optimizer and memory-format choices; --compile."""
import io
import shutil
import warnings
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st
import numpy as np
import torch
from PIL import Image
from torchvision import transforms

from common import cli, data, device_input, engine, image_files, jpeg_decoders, models, pipelines, precision
from common.tools.demo_data import write_fake_imagenet
from common.distributed import single_process
from common.device_input import DeviceInput
from common.image_files import BadImageError
from common.pipelines import EncodedImages, PILImages, TensorImages
from helpers import jpeg_variants, load_checkpoint, make_image_folder, run_script

STD_255 = torch.tensor(pipelines.IMAGENET_STD).reshape(3, 1, 1) * 255.0  # normalised units -> gray levels


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> list:
    """ImageNet-shaped JPEGs (about 500 x 375), plus a grayscale, a CMYK and
    a progressive JPEG and a PNG: every route through the fast backend."""
    root = tmp_path_factory.mktemp("fake") / "tree"
    write_fake_imagenet(root, classes=1, train_per_class=12, val_per_class=1)
    paths = sorted(str(path) for path in (root / "train").rglob("*.JPEG"))
    source = Image.open(paths[0]).convert("RGB")
    extra = root / "extra"
    extra.mkdir()
    source.convert("L").save(extra / "gray.jpg", quality=90)
    source.convert("CMYK").save(extra / "cmyk.jpg", quality=90)
    source.save(extra / "progressive.jpg", quality=90, progressive=True)
    source.save(extra / "image.png")
    return paths + sorted(str(path) for path in extra.iterdir())


def gray_levels(reference: torch.Tensor, fast_uint8: torch.Tensor) -> torch.Tensor:
    """|reference - fast| per pixel, in 0..255 gray levels."""
    return ((reference - device_input.normalize(fast_uint8)) * STD_255).abs()


def both(path: str, reference, fast, seed: int):
    torch.manual_seed(seed)
    expected, expected_bytes, _ = reference(path)
    torch.manual_seed(seed)
    got, got_bytes, _ = fast(path)
    assert got.dtype == torch.uint8 and got_bytes == expected_bytes == Path(path).stat().st_size
    return expected, got


@pytest.mark.parametrize("train", [True, False], ids=["train-crop", "val-centre-crop"])
def test_the_fast_path_cuts_the_pil_paths_crop_within_one_gray_level(jpegs, train):
    reference = PILImages(pipelines.train_transform(224) if train else pipelines.val_transform(224, 256))
    fast = TensorImages(train, 224, val_resize=256)
    for seed, path in enumerate(jpegs):
        expected, got = both(path, reference, fast, seed)
        assert got.shape == expected.shape == (3, 224, 224)
        difference = gray_levels(expected, got)
        # Pillow and torch resample with the same antialiased bilinear filter, rounded to uint8 by
        # each: they differ by at most one level; a crop off by a pixel would differ by tens.
        assert difference.max() <= 1.001, (path, difference.max())
        assert difference.mean() <= 0.3, (path, difference.mean())


def test_reduced_size_decoding_keeps_the_crop_within_a_few_gray_levels(jpegs):
    """64-pixel crops of ~500 x 375 images: most are decoded at 1/2 or 1/4
    size (the DCT-domain scaling); they still show the same picture."""
    reference, fast = PILImages(pipelines.train_transform(64)), TensorImages(True, 64)
    reduced = 0
    for seed, path in enumerate(jpegs):
        torch.manual_seed(seed)
        with Image.open(path) as image:
            width, height = image.size
        reduced += fast.geometry(width, height).reduction(width, height) > 1
        expected, got = both(path, reference, fast, seed)
        difference = gray_levels(expected, got)
        # The fake images carry strong pixel-level grain (sigma 20), which DCT scaling and an area
        # filter average differently; a wrong box would differ by ~50 on average.
        assert difference.mean() <= 8.0, (path, difference.mean())
    assert reduced >= len(jpegs) // 2  # the reduced path was taken, for most images


def test_every_backend_draws_the_reference_random_parameters(jpegs):
    """The same torch draws, in the same order, as RandomResizedCrop.get_params then the flip."""
    path = jpegs[0]
    with Image.open(path) as image:
        for seed in range(20):
            torch.manual_seed(seed)
            box = transforms.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
            flip = bool(torch.rand(1) < 0.5)
            torch.manual_seed(seed)
            geometry = TensorImages(True, 224).geometry(*image.size)
            assert (geometry.crop, geometry.flip) == (box, flip)


def test_the_gpu_backend_decodes_in_the_main_process_to_the_same_images(jpegs):
    """The gpu backend's route (bytes and geometry from the worker, one
    batched decode, crops on the decoding device), run on the CPU: the same
    pixels as the torchvision backend; non-JPEGs come finished from the worker."""
    encoder, fast = EncodedImages(True, 96, reduced_decode=False), TensorImages(True, 96, reduced_decode=False)
    samples, expected = [], []
    for seed, path in enumerate(jpegs):
        torch.manual_seed(seed)
        encoded, file_bytes, _ = encoder(path)
        samples.append(data.Sample(encoded, 0, file_bytes))
        torch.manual_seed(seed)
        expected.append(fast(path)[0])
    batch = data.collate(samples)
    assert isinstance(batch.image, device_input.EncodedBatch) and batch.file_bytes.tolist() == [
        Path(path).stat().st_size for path in jpegs]
    assert batch.image.is_jpeg.count(False) == 2  # the PNG and the CMYK JPEG are finished in the worker
    assert batch.image.data.numel() == sum(batch.image.lengths)  # the JPEGs' bytes in one tensor
    decoded = batch.image.decode(torch.device("cpu"))
    assert torch.equal(decoded, torch.stack(expected))


def test_a_truncated_jpeg_is_unreadable_for_every_backend_with_pillows_reason(jpegs, tmp_path):
    truncated = tmp_path / "truncated.JPEG"
    encoded = Path(jpegs[0]).read_bytes()
    truncated.write_bytes(encoded[:len(encoded) // 2])
    reasons = set()
    for backend in (PILImages(pipelines.train_transform(64)), TensorImages(True, 64), EncodedImages(True, 64)):
        with pytest.raises(BadImageError) as caught:
            backend(str(truncated))
        assert str(truncated) in str(caught.value)
        reasons.add(caught.value.reason)
    assert len(reasons) == 1 and "truncated" in reasons.pop()


def test_device_input_normalises_uint8_as_to_tensor_and_normalize_do():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    expected = transforms.Normalize(pipelines.IMAGENET_MEAN, pipelines.IMAGENET_STD)(images.float() / 255.0)
    for channels_last in (False, True):
        batch = data.Sample(images, torch.arange(4), torch.zeros(4))
        finished = next(iter(DeviceInput(torch.device("cpu"), channels_last)([batch])))
        assert finished.image.dtype == torch.float32
        assert torch.allclose(finished.image, expected, atol=1e-5)
        assert finished.image.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert torch.equal(finished.target, torch.arange(4))
    already = data.Sample(expected, torch.arange(4), torch.zeros(4))  # the pil backend's float batches only move
    assert torch.equal(next(iter(DeviceInput(torch.device("cpu"))([already]))).image, expected)


def test_synthetic_images_are_uint8_and_normalised_on_the_device():
    dataset = data.SyntheticImages(length=10, image_size=16, num_classes=3, seed=0)
    sample = dataset[3]
    assert sample.image.dtype == torch.uint8 and sample.image.shape == (3, 16, 16)
    assert sample.image.unsqueeze(0).is_contiguous(memory_format=torch.channels_last)  # as decoded images are
    assert torch.equal(dataset[3].image, dataset[3].image)  # a pool: the same tensor each time


@pytest.mark.parametrize("backend", ["torchvision", "synthetic"])
def test_uint8_batches_leave_the_workers_channels_last_with_the_images_pixels(tiny_data, backend):
    """Batches are stacked in the layout the images are made in (stack_images):
    the same pixels as torch.stack, interleaved, across the worker's shared
    memory; both memory formats then finish to the same floats."""
    source = ["--synthetic"] if backend == "synthetic" else [str(tiny_data)]
    cfg = cli.parse("nd", source + ["-b", "4", "-j", "1", "--image-size", "24", "--val-resize", "28"])
    loaders = data.build_loaders(cfg, single_process("cpu"))
    loaders.set_epoch(0)
    dataset = loaders.train.dataset
    indices = list(loaders.train.sampler)[:4]
    batch = next(iter(loaders.train))
    assert batch.image.shape == (4, 3, 24, 24) and batch.image.dtype == torch.uint8
    assert batch.image.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(batch.image, torch.stack([dataset[index].image for index in indices]))  # the same draws
    planar, interleaved = (DeviceInput(torch.device("cpu"), channels_last).images(batch.image) for channels_last in
                           (False, True))
    assert planar.is_contiguous() and interleaved.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(planar, interleaved)


def test_one_loader_per_backend_yields_the_same_batches_within_a_gray_level(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2, size=48)
    batches = {}
    for backend in ("pil", "torchvision"):
        cfg = cli.parse("nd", [str(root), "-b", "4", "-j", "0", "--image-size", "32", "--val-resize", "40",
                               "--data-backend", backend])
        loaders = data.build_loaders(cfg, single_process("cpu"))
        loaders.set_epoch(0)
        finish = DeviceInput(torch.device("cpu"))
        batches[backend] = [finish.batch(batch) for loader in (loaders.train, loaders.val) for batch in loader]
    assert len(batches["pil"]) == len(batches["torchvision"]) == 3  # 8 training and 4 validation images, by 4
    for reference, fast in zip(batches["pil"], batches["torchvision"]):
        assert torch.equal(reference.target, fast.target)
        assert ((reference.image - fast.image) * STD_255).abs().max() <= 1.001


@pytest.mark.slow
def test_the_gpu_backend_is_refused_on_the_cpu_with_one_line(tiny_data):
    completed = run_script(["imagenet_nd.py", str(tiny_data), "--data-backend", "gpu", "--epochs", "1"])
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        "imagenet_nd.py: error: argument --data-backend: gpu decodes JPEGs on a CUDA GPU; this run is on the CPU "
        "(use torchvision)"]


def test_sgd_is_foreach_on_the_cpu_and_equal_to_the_plain_loop():
    torch.manual_seed(0)
    plain_model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    fast_model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    fast_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)
    fast = engine.sgd(fast_model, 0.1, 0.9, 1e-4)
    assert fast.defaults["foreach"] is True and not fast.defaults.get("fused")
    inputs = torch.randn(8, 5)
    for _ in range(5):
        for model, optimizer in ((plain_model, plain), (fast_model, fast)):
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
    for a, b in zip(plain_model.parameters(), fast_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("memory_format,device,opt_level,expected", [
    ("auto", "cpu", "O0", True),  # oneDNN's layout
    ("auto", "cuda", "O0", False),  # fp32 on a GPU: NCHW
    ("auto", "cuda", "O1", False),  # Apex O1 leaves the model alone
    ("auto", "cuda", "O2", True),  # tensor cores
    ("contiguous", "cpu", "O0", False),
    ("contiguous", "cuda", "O2", False),  # asked for: honoured
    ("channels_last", "cuda", "O0", True),
])
def test_memory_format_auto_follows_device_and_opt_level(memory_format, device, opt_level, expected):
    device = torch.device(device)
    policy = precision.FP32() if opt_level == "O0" else precision.MixedPrecision(opt_level, torch.float16, device)
    assert models.uses_channels_last(memory_format, device, policy) is expected


def test_channels_last_flag_is_the_memory_format_flag():
    assert cli.parse("nd", ["--synthetic", "--channels-last"]).memory_format == "channels_last"
    assert cli.parse("nd", ["--synthetic"]).memory_format == "auto"
    assert not hasattr(cli.build_parser("dp").parse_args(["--synthetic"]), "compile")  # no --compile with DataParallel


def _compiler_available() -> bool:
    try:
        import torch._inductor  # noqa: F401
    except Exception:
        return False
    return hasattr(torch, "compile") and (shutil.which("cc") or shutil.which("gcc")) is not None


@pytest.mark.slow
@pytest.mark.skipif(not _compiler_available(), reason="torch.compile (inductor and a C compiler) unavailable")
def test_compile_trains_a_few_cpu_steps_like_the_eager_model(tmp_path):
    """--compile: the compiled model trains (loss finite, the same images
    counted) and lands in a checkpoint any script loads (no _orig_mod. keys)."""
    argv = ["imagenet_nd.py", "--synthetic", "-a", "resnet18", "-b", "4", "--image-size", "32", "--val-resize", "32",
            "-j", "0", "--epochs", "1", "--steps-per-epoch", "3", "--throughput-warmup-steps", "0",
            "--checkpoint-every", "0", "--io-interval", "0", "--logdir", str(tmp_path)]
    completed = run_script([*argv, "--compile", "--run-name", "compiled"], timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    completed = run_script([*argv, "--run-name", "eager"], timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    import pandas

    rows = {name: pandas.read_csv(tmp_path / name / "metrics.csv").query("split == 'train'").iloc[0]
            for name in ("compiled", "eager")}
    assert rows["compiled"]["images"] == rows["eager"]["images"] == 12
    # Same seed, same data: the compiled graph's arithmetic differs only by rounding (fused kernels).
    assert abs(rows["compiled"]["loss"] - rows["eager"]["loss"]) <= 1e-3 * abs(rows["eager"]["loss"])
    state = load_checkpoint(tmp_path / "compiled" / "checkpoint.pth.tar")
    assert not any(key.startswith("_orig_mod") for key in state["state_dict"])


def test_a_batch_the_device_decoder_refuses_is_decoded_file_by_file_with_a_warning(tmp_path):
    """The gpu backend's batch decode (here on the CPU, the same code): a
    batch the decoder refuses goes file by file, which is slow, so it says
    so; the good file is decoded anyway and the bad one is named."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((16, 24, 3), 200, np.uint8)).save(buffer, format="JPEG")
    good, bad = buffer.getvalue(), b"\xff\xd8\xff\xe0" + bytes(200)
    files = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in (good, good)]
    decoder = jpeg_decoders.choose_jpeg_decoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error", device_input.GPUDecodeFallback)
        decoded = device_input._decode_on(decoder, torch.device("cpu"), files, ["a.jpg", "b.jpg"])
    assert [tuple(image.shape) for image in decoded] == [(3, 16, 24)] * 2
    files[1] = torch.frombuffer(bytearray(bad), dtype=torch.uint8)
    with pytest.warns(device_input.GPUDecodeFallback, match="refused a batch"), \
            pytest.raises(image_files.BadImageError, match=r"^b\.jpg: cannot decode image .*too late for --bad-images"):
        device_input._decode_on(decoder, torch.device("cpu"), files, ["a.jpg", "b.jpg"])


JPEG_VARIANTS = jpeg_variants()


@pytest.mark.parametrize("variant", sorted(JPEG_VARIANTS))
def test_the_jpeg_header_is_read_as_pillow_reads_it(variant):
    encoded = JPEG_VARIANTS[variant]
    with Image.open(io.BytesIO(encoded)) as image:
        assert jpeg_decoders.jpeg_header(encoded) == (*image.size, image.mode, "exif" in image.info)
    # A fill byte before a marker is allowed; bytes that are no marker end the walk.
    assert jpeg_decoders.jpeg_header(encoded[:2] + b"\xff" + encoded[2:]) == jpeg_decoders.jpeg_header(encoded)
    assert jpeg_decoders.jpeg_header(encoded[:2] + b"\x00" + encoded[2:]) is None


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(cut=st.integers(0, len(JPEG_VARIANTS["exif and icc"])), tail=st.binary(max_size=40))
def test_the_jpeg_header_of_any_truncated_or_damaged_file_is_the_header_or_none(cut, tail):
    """Never an exception: a file cut short or continued with noise reads as
    the right header when its frame header is whole, else as None (then
    Pillow decides about the file)."""
    whole = JPEG_VARIANTS["exif and icc"]
    header = jpeg_decoders.jpeg_header(whole[:cut] + tail)
    frame = whole.index(b"\xff\xc0")  # the frame header ends 10 bytes after its marker
    if cut >= frame + 10:
        assert header == (37, 23, "RGB", True)
    else:
        assert header is None or header[2] in ("L", "RGB", "CMYK")

"""Issue 21, items 10-12: the JPEG decoder of the fast backends (TorchCodec,
torchvision.io or Pillow) is chosen once per run, said in the header and
recorded in config.json; every one of them cuts the same crops; torchvision's
deprecation is not repeated by the data-loading workers; images above
Pillow's decompression-bomb limit are counted and one is named, once."""
import importlib
import io
import json
import sys
import types
import warnings

import numpy as np
import PIL
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import imagenet_nd
from common import jpeg_decoders, pipelines
from common.jpeg_decoders import JpegDecoder
from common.pipelines import TensorImages
from common.tools.demo_data import write_fake_imagenet
from helpers import encode_jpeg, jpeg_variants, make_image_folder

# Measured on the images below (Pillow 13, torchvision 0.29, TorchCodec 0.17, all libjpeg-turbo 3):
# 0 gray levels between any two decoders. The bound leaves room for another libjpeg build's IDCT
# (they differ by a level or two); a crop off by one pixel differs by tens on these grainy images.
DECODER_GRAY_LEVELS = 2


def decoder(name: str) -> JpegDecoder:
    """The library `name` as a run would use it; the test is skipped where it
    is not installed or does not work here."""
    if name == "pillow":
        return JpegDecoder("pillow", PIL.__version__)
    try:
        version = importlib.import_module(name).__version__
    except ImportError:
        pytest.skip(f"{name} is not installed (optional: {jpeg_decoders.TORCHCODEC_INSTALL})")
    chosen = JpegDecoder(name, version)
    try:
        chosen.decode(torch.frombuffer(bytearray(encode_jpeg("RGB")), dtype=torch.uint8))
    except Exception as error:  # e.g. a TorchCodec built for another torch
        pytest.skip(f"{name} {version} does not work beside torch {torch.__version__}: {error}")
    return chosen


def _turned(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[jpeg_decoders.EXIF_ORIENTATION] = orientation
    return encode_jpeg("RGB", size=(64, 40), exif=exif.tobytes())


JPEG_VARIANTS = {**{name: encoded for name, encoded in jpeg_variants().items() if name != "large"},
                 "exif upright": _turned(1), "exif turned 90": _turned(6), "exif mirrored": _turned(2)}


@pytest.fixture(scope="module")
def jpeg_files(tmp_path_factory) -> list:
    """ImageNet-shaped JPEGs (about 500 x 375) and every variant above, as files."""
    root = tmp_path_factory.mktemp("decoders")
    write_fake_imagenet(root / "tree", classes=1, train_per_class=6, val_per_class=1)
    paths = sorted(str(path) for path in (root / "tree" / "train").rglob("*.JPEG"))
    for index, encoded in enumerate(JPEG_VARIANTS.values()):
        (root / f"variant{index}.jpg").write_bytes(encoded)
        paths.append(str(root / f"variant{index}.jpg"))
    return paths


@pytest.mark.parametrize("name", ["torchvision", "torchcodec"])
@pytest.mark.parametrize("train", [True, False], ids=["train-crop", "val-centre-crop"])
def test_every_jpeg_decoder_cuts_pillows_crop_within_two_gray_levels(jpeg_files, name, train):
    """The same crop box and flip from the same seed, and the same pixels:
    the decoder changes the speed, never the data. Files with an EXIF
    orientation, which TorchCodec would turn, are left to Pillow."""
    chosen, reference = decoder(name), decoder("pillow")
    for seed, path in enumerate(jpeg_files):
        outputs = []
        for used in (chosen, reference):
            torch.manual_seed(seed)
            outputs.append(TensorImages(train, 32, val_resize=40, reduced_decode=False, decoder=used)(path))
        (got, got_bytes, _), (expected, expected_bytes, _) = outputs
        assert got.shape == expected.shape == (3, 32, 32) and got_bytes == expected_bytes
        difference = (got.int() - expected.int()).abs().max().item()
        assert difference <= DECODER_GRAY_LEVELS, (path, difference)
    encoded = JPEG_VARIANTS["exif turned 90"]
    with Image.open(io.BytesIO(encoded)) as image:
        assert image.size == (64, 40) and not pipelines._tensor_decodable(image)  # Pillow's, so not turned
    if name == "torchcodec":  # why: TorchCodec applies the orientation
        assert chosen.decode(torch.frombuffer(bytearray(encoded), dtype=torch.uint8)).shape == (3, 64, 40)


def test_the_decoder_is_chosen_best_first_and_says_why_it_passed_one_over(monkeypatch):
    """TorchCodec when it imports and decodes; a missing one, one that fails
    beside this torch, and a torchvision without its image extension are
    passed over, each with its reason in the header's one line."""
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # not installed
    chosen = jpeg_decoders.choose_jpeg_decoder()
    assert (chosen.name, chosen.version) == ("torchvision", importlib.import_module("torchvision").__version__)
    assert chosen.passed_over == (f"torchcodec: not installed, {jpeg_decoders.TORCHCODEC_INSTALL}",)
    assert chosen.describe().startswith(f"JPEG decoding: torchvision.io {chosen.version} (deprecated since "
                                        f"torchvision 0.29 in favour of TorchCodec; torchcodec: not installed")

    broken = types.ModuleType("torchcodec")
    broken.__version__ = "0.99.0"
    broken_decoders = types.ModuleType("torchcodec.decoders")

    def fails(*args, **kwargs):
        raise OSError("libtorchcodec_core7.so: undefined symbol: _ZN3c10\nmore lines")

    broken_decoders.decode_jpeg = fails
    monkeypatch.setitem(sys.modules, "torchcodec", broken)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", broken_decoders)
    undefined_symbol = "torchcodec: libtorchcodec_core7.so: undefined symbol: _ZN3c10"  # the first line only
    assert jpeg_decoders.choose_jpeg_decoder().passed_over == (undefined_symbol,)

    no_extension = types.ModuleType("torchvision.io")
    no_extension.ImageReadMode = types.SimpleNamespace(RGB="RGB")
    no_extension.decode_jpeg = lambda *args, **kwargs: (_ for _ in ()).throw(
        RuntimeError("Couldn't load the image extension."))
    monkeypatch.setitem(sys.modules, "torchvision.io", no_extension)
    chosen = jpeg_decoders.choose_jpeg_decoder()
    assert chosen == JpegDecoder("pillow", PIL.__version__,
                                 (undefined_symbol, "torchvision: Couldn't load the image extension."))
    assert not chosen.makes_tensors


class _WarningsPerImage(Dataset):
    """Each image of `paths` through `pipeline`, with the warnings it raised
    in the data-loading worker (every one, not once per place)."""

    def __init__(self, paths, pipeline):
        self.paths, self.pipeline = paths, pipeline

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            image = self.pipeline(self.paths[index]).image
        return image, [f"{warning.category.__name__}: {warning.message}" for warning in caught]


def test_torchvisions_deprecation_is_not_repeated_by_the_workers_but_said_once_in_the_header(jpeg_files):
    """torchvision.io warns on every decode; the workers say nothing, and the
    header says it once (JpegDecoder.describe): the choice is made before
    the workers start, and they inherit it."""
    chosen = decoder("torchvision")
    paths = jpeg_files * 3
    loader = DataLoader(_WarningsPerImage(paths, TensorImages(False, 32, val_resize=40, decoder=chosen)),
                        batch_size=4, num_workers=2, collate_fn=list)
    said = [warning for batch in loader for image, caught in batch for warning in caught]
    images = sum(len(batch) for batch in loader)
    assert images == len(paths) and said == []
    with warnings.catch_warnings(record=True) as caught:  # what the workers were spared
        warnings.simplefilter("always")
        importlib.import_module("torchvision.io").decode_jpeg(
            torch.frombuffer(bytearray(JPEG_VARIANTS["baseline"]), dtype=torch.uint8))
    assert [warning.category for warning in caught] == [DeprecationWarning]
    assert chosen.describe().count("deprecated since torchvision 0.29") == 1


def test_large_images_are_counted_and_one_named_once_and_the_decoder_is_in_the_header_and_config(
        tmp_path, monkeypatch, capsys, recwarn):
    """Two training and one validation image above a (lowered) Pillow limit:
    one line per split in the whole run, with the count and one file, instead
    of Pillow's DecompressionBombWarning, which names none."""
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2, size=24)
    large = [root / "train" / "class_0" / "001.JPEG", root / "train" / "class_1" / "003.JPEG",
             root / "val" / "class_1" / "000.JPEG"]
    for path in large:  # 40 x 40 = 1600 pixels: above the limit, below twice it (which Pillow refuses)
        Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(path, quality=90)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    imagenet_nd.main([str(root), "-a", "resnet18", "--image-size", "16", "--val-resize", "16", "-b", "4", "-j", "0",
                      "--epochs", "2", "-p", "100", "--logdir", str(tmp_path / "runs")])
    lines = capsys.readouterr().out.splitlines()
    notes = [line for line in lines if "decompression-bomb" in line]

    def note(count, where, example):
        return (f"note: {count} image(s) of {where} above Pillow's decompression-bomb limit of 1,000 pixels "
                f"(PIL.Image.MAX_IMAGE_PIXELS), e.g. {example}: decoded anyway, each slowly and with much memory; "
                f"said once")

    assert len(notes) == 2 and notes[0] in [note(2, "train epoch 0", path) for path in large[:2]]  # the first met
    assert notes[1] == note(1, "val epoch 0", large[2])
    assert not [warning for warning in recwarn if issubclass(warning.category, Image.DecompressionBombWarning)]

    chosen = jpeg_decoders.choose_jpeg_decoder()
    assert [line for line in lines if line.startswith("JPEG decoding: ")] == [chosen.describe()]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "config.json").read_text())["resolved"]["jpeg_decoder"] == {
        "name": chosen.name, "version": chosen.version, "passed_over": list(chosen.passed_over)}

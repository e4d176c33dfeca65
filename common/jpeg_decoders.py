"""JPEG decoders: which library decodes whole JPEGs into tensors for a run
(JpegDecoder, chosen once by choose_jpeg_decoder: TorchCodec, torchvision.io
or Pillow, all libjpeg-turbo underneath), and a JPEG's header read by hand
(jpeg_header), ten times faster than Pillow's look at the file.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import warnings
from typing import NamedTuple, Optional, Tuple

import numpy as np
import PIL
import torch
from PIL import Image

from common.errors import error_summary
from common.image_files import decode_rgb, uint8_tensor

JPEG_START = b"\xff\xd8\xff"  # SOI marker and the next marker's first byte
JPEG_END = b"\xff\xd9"  # EOI marker
_FRAME_MARKERS = (0xC0, 0xC1, 0xC2)  # SOF0-2: baseline, extended and progressive Huffman-coded frames
_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}  # by component count, as Pillow names them
_EXIF_MARKER, _EXIF_START = 0xE1, b"Exif\x00\x00"  # APP1, and how an EXIF block in it starts
# The JPEG decoders that make tensors, best first (see JpegDecoder); Pillow is the last resort.
TENSOR_JPEG_DECODERS = ("torchcodec", "torchvision")
TORCHCODEC_INSTALL = "pip install -r requirements-torchcodec.txt"
EXIF_ORIENTATION = 0x0112  # the EXIF tag; 1 is upright


@dataclasses.dataclass(frozen=True)
class JpegDecoder:
    """The library that decodes whole JPEGs into tensors on the torchvision
    and gpu backends: TorchCodec, torchvision.io (whose image decoders
    torchvision 0.29 deprecates in favour of TorchCodec's) or, where neither
    works, Pillow. Chosen once per run (choose_jpeg_decoder) and handed to
    the data-loading workers with their pipeline, so they neither probe nor
    warn; the run's header says which (describe) and config.json records it.
    All three are libjpeg-turbo underneath: the same pixels, and so the same
    crops (tests/unit/test_decoders.py)."""

    name: str  # torchcodec | torchvision | pillow
    version: str
    passed_over: Tuple[str, ...] = ()  # why each better one is not used: "<name>: <reason>"

    @property
    def makes_tensors(self) -> bool:
        return self.name in TENSOR_JPEG_DECODERS

    def decode(self, data, device: torch.device = torch.device("cpu")):
        """A JPEG (a 1-D uint8 tensor, or a list of them) as 3 x H x W RGB
        uint8 on `device`; raises what the library raises on bad data."""
        if self.name == "torchcodec":
            return importlib.import_module("torchcodec.decoders").decode_jpeg(data, mode="RGB", device=device)
        image_io = importlib.import_module("torchvision.io")
        with warnings.catch_warnings():
            # Its DeprecationWarning, once in every data-loading worker, would say what the run's header
            # already says (describe), with no file or advice of ours.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return image_io.decode_jpeg(data, mode=image_io.ImageReadMode.RGB, device=device)

    def decode_or_none(self, encoded: bytes) -> Optional[torch.Tensor]:
        """decode on the CPU, or None where the library refuses the file:
        then Pillow decides, so every backend calls the same files unreadable."""
        try:
            return self.decode(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        except Exception:
            return None

    def describe(self) -> str:
        """One line for the run's header."""
        library = {"torchcodec": "TorchCodec", "torchvision": "torchvision.io", "pillow": "Pillow"}[self.name]
        notes = list(self.passed_over)
        if self.name == "torchvision" and _version_tuple(self.version) >= (0, 29):
            notes.insert(0, "deprecated since torchvision 0.29 in favour of TorchCodec")
        return f"JPEG decoding: {library} {self.version}" + (f" ({'; '.join(notes)})" if notes else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def choose_jpeg_decoder() -> JpegDecoder:
    """The first of TorchCodec and torchvision.io that imports and decodes a
    test JPEG to Pillow's pixels (within 2 gray levels: IDCTs may differ by
    one or two), else Pillow. A missing or broken library (TorchCodec built
    for another torch, torchvision without its image extension) is passed
    over with its reason. Call it once per run (data.build_loaders does)."""
    buffer = io.BytesIO()
    gradient = np.add.outer(np.arange(16), np.arange(24)).astype(np.uint8) * 8
    Image.fromarray(np.stack([gradient, 255 - gradient, gradient // 2], axis=-1)).save(buffer, format="JPEG")
    probe = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    expected = uint8_tensor(decode_rgb(buffer.getvalue(), "<test JPEG>")).int()
    passed_over = []
    for name in TENSOR_JPEG_DECODERS:
        try:
            version = importlib.import_module(name).__version__
            decoded = JpegDecoder(name, version).decode(probe)
            if decoded.shape != expected.shape or int((decoded.int() - expected).abs().max()) > 2:
                raise ValueError(f"decodes a test JPEG unlike Pillow (shape {tuple(decoded.shape)})")
            return JpegDecoder(name, version, tuple(passed_over))
        except ModuleNotFoundError as error:
            why = f"not installed, {TORCHCODEC_INSTALL}" if name == "torchcodec" else error_summary(error)
            passed_over.append(f"{name}: {why}")
        except Exception as error:  # a wheel built for another torch fails in many ways: OSError, RuntimeError, ...
            passed_over.append(f"{name}: {error_summary(error, limit=160)}")
    return JpegDecoder("pillow", PIL.__version__, tuple(passed_over))


def _version_tuple(version: str) -> Tuple[int, ...]:
    """"0.29.1+cu130" -> (0, 29, 1)."""
    return tuple(int(part) for part in version.split("+")[0].split(".") if part.isdigit())




class JpegHeader(NamedTuple):
    width: int
    height: int
    mode: str  # as Pillow names it: L, RGB or CMYK
    exif: bool  # it has an EXIF block, which may say the image is stored turned

    @property
    def size(self) -> Tuple[int, int]:
        return self.width, self.height


def jpeg_header(encoded: bytes) -> Optional[JpegHeader]:
    """The header of an 8-bit baseline or progressive grayscale, colour or
    CMYK JPEG, read from its frame header (SOF) by walking the marker
    segments: 3 us where Pillow's Image.open takes 33 us alone and about 60 us
    of CPU inside the torchvision backend, whose whole transform of a 105 KB
    ImageNet-sized JPEG takes 1.8-2.4 ms: it saves 3-4% of it (measured
    2026-11-25, thread CPU time, medians over 20 files x 8 rounds). None for
    anything else (lossless, arithmetic-coded or 12-bit JPEGs, damaged
    headers): Pillow decides."""
    if not encoded.startswith(JPEG_START):
        return None
    position, end, exif = 2, len(encoded), False
    while position + 4 <= end:
        if encoded[position] != 0xFF:
            return None
        marker = encoded[position + 1]
        if marker == 0xFF:  # a fill byte before the marker
            position += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # segments without a length
            position += 2
        elif marker in _FRAME_MARKERS:
            if position + 10 > end:
                return None
            precision, components = encoded[position + 4], encoded[position + 9]
            height = int.from_bytes(encoded[position + 5:position + 7], "big")
            width = int.from_bytes(encoded[position + 7:position + 9], "big")
            mode = _JPEG_MODES.get(components)
            if precision != 8 or width == 0 or height == 0 or mode is None:
                return None
            return JpegHeader(width, height, mode, exif)
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker in (0xD9, 0xDA):
            return None  # another frame type, or the image data (or its end) before any frame header
        else:
            exif = exif or marker == _EXIF_MARKER and encoded.startswith(_EXIF_START, position + 4)
            position += 2 + int.from_bytes(encoded[position + 2:position + 4], "big")
    return None

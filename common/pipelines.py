"""Image pipelines: from an image file to the tensor a model takes.

Four backends (--data-backend), one set of random parameters. The
training crop and flip are drawn the same way by all four (torchvision's
RandomResizedCrop.get_params, then one draw for the flip), from the torch
generator common.data seeds per image, so for one seed every backend cuts
the same box of the same image; only the resampling arithmetic differs
(tests/test_pipelines.py bounds the pixel difference).

  pil          the plain reference: Pillow decodes, crops and resizes, then
               ToTensor and Normalize make float32 in the data-loading
               worker (what torchvision's ImageNet example does).
  torchvision  the default: JPEGs are decoded straight into a tensor by
               the JPEG decoder chosen once per run (JpegDecoder: TorchCodec
               where it is installed and works, else torchvision.io, else
               Pillow; all three are libjpeg-turbo), or by Pillow at
               1/2, 1/4 or 1/8 size in the DCT domain (its draft mode)
               when the crop is shrunk at least that much anyway; cropping,
               resizing and flipping run on uint8 tensors. Workers hand
               over uint8 batches (4x fewer bytes than float32 through
               shared memory, and pinned memory, to the GPU) in the
               channels-last layout the decoder and the resize leave
               them in (stack_images); conversion to float, normalisation
               and the model's memory format happen on the device (DeviceInput).
               Other formats (PNG, ...) and JPEGs torchvision cannot read
               are decoded by Pillow, then follow the same tensor path.
  gpu          workers only read the file and draw the crop; nvJPEG decodes
               the batch on the GPU (the chosen decoder's decode_jpeg(...,
               device="cuda")), where it is also cropped and resized. Files
               that are not complete JPEGs take the torchvision path in the worker.
  dali         the gpu backend's workers (DaliImages); NVIDIA DALI decodes
               the crop's region of each JPEG on the device, resizes and
               flips it (common.dali; DALI itself is imported only for this
               backend).

Images above Pillow's decompression-bomb limit are noted (Loaded.large_pixels)
instead of letting Pillow warn without naming them: the training loop counts
them and names one, once (data.BadImages).

DeviceInput moves batches to the device and finishes them there
(normalisation, memory format, GPU decoding); on a GPU it prepares the next
batch on a side stream while the current step runs.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import warnings
from typing import Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import PIL
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import default_collate
from torchvision import transforms
from torchvision.transforms.v2 import functional as tensor_ops

from common.errors import UsageError, error_summary

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's aspect-ratio range
JPEG_START = b"\xff\xd8\xff"  # SOI marker and the next marker's first byte
JPEG_END = b"\xff\xd9"  # EOI marker
_FRAME_MARKERS = (0xC0, 0xC1, 0xC2)  # SOF0-2: baseline, extended and progressive Huffman-coded frames
_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}  # by component count, as Pillow names them
_EXIF_MARKER, _EXIF_START = 0xE1, b"Exif\x00\x00"  # APP1, and how an EXIF block in it starts
# The JPEG decoders that make tensors, best first (see JpegDecoder); Pillow is the last resort.
TENSOR_JPEG_DECODERS = ("torchcodec", "torchvision")
TORCHCODEC_INSTALL = "pip install -r requirements-torchcodec.txt"
EXIF_ORIENTATION = 0x0112  # the EXIF tag; 1 is upright

# Pillow warns about harmless oddities it decodes anyway (corrupt EXIF blocks, which some ImageNet
# JPEGs have; palette transparency), once per data-loading worker and epoch: noise in a long log.
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")


class BadImageError(UsageError):
    """An image file that cannot be decoded; the message names the file."""

    rank_specific = True  # only the process whose share holds the file meets it

    def __init__(self, message: str, reason: str = ""):
        # A DataLoader worker's exception reaches the main process rebuilt as
        # type(error)("Caught ... Original Traceback ...\n...BadImageError: <message>");
        # keep only the original one-line message, so the user sees one line.
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)
        self.reason = reason  # why the file cannot be decoded, without the path


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        _unreadable(path, error.strerror or error_summary(error))


def _unreadable(path: str, reason: str):
    raise BadImageError(
        f"{path}: cannot decode image ({reason}); remove or replace the file, or pass --bad-images skip",
        reason=reason) from None


def open_image(encoded: bytes, path: str) -> Image.Image:
    """Pillow's look at an image file: its header only (size, mode, format,
    EXIF), about 33 us for an ImageNet JPEG; the pixels are decoded later
    (load_rgb), or by another decoder. Pillow's DecompressionBombWarning, for
    an image above its limit, is kept in: it would come once per
    data-loading worker, without the file's name. Instead large_pixels notes
    the image, and the training loop counts them and names one (data.BadImages)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(encoded))
    except Exception as error:  # Pillow's decoders raise many types on bad data (OSError, SyntaxError, ...)
        _unreadable(path, _decode_failure(error, encoded))


def load_rgb(image: Image.Image, encoded: bytes, path: str,
             draft_size: Optional[Tuple[int, int]] = None) -> Image.Image:
    """The pixels of an open_image as 8-bit, 3-channel RGB (grayscale, CMYK,
    palette, RGBA and 16-bit images included). `draft_size`: a JPEG may be
    decoded smaller, down to this size (DCT scaling)."""
    try:
        if draft_size is not None:
            image.draft("RGB", draft_size)
        image.load()  # the full decode: truncation shows here
        return _eight_bit(image).convert("RGB")
    except Exception as error:
        _unreadable(path, _decode_failure(error, encoded))


def _decode_failure(error: Exception, encoded: bytes) -> str:
    """Why Pillow could not open or decode a file, in one line without the path."""
    if encoded == b"":
        return "empty file"
    if isinstance(error, UnidentifiedImageError):  # its message names our in-memory copy, not the file
        return f"not an image format Pillow reads ({len(encoded)} bytes starting {encoded[:8]!r})"
    return error.strerror if isinstance(error, OSError) and error.strerror else error_summary(error)


def decode_rgb(encoded: bytes, path: str, draft_size: Optional[Tuple[int, int]] = None) -> Image.Image:
    """Pillow's decode of any image file as 8-bit RGB (see load_rgb); the
    format is read from the content, whatever the extension says."""
    with open_image(encoded, path) as image:
        return load_rgb(image, encoded, path, draft_size)


def read_rgb(path: str) -> Tuple[Image.Image, int]:
    """The file decoded by Pillow as RGB, and the bytes read from it (read
    whole first, as decoding would anyway, which makes the count exact)."""
    encoded = read_file(path)
    return decode_rgb(encoded, path), len(encoded)


def large_pixels(size: Tuple[int, int]) -> int:
    """An image's pixel count when it is above Pillow's decompression-bomb
    limit (PIL.Image.MAX_IMAGE_PIXELS, where Pillow warns; twice that is
    refused, an unreadable file), else 0."""
    pixels = size[0] * size[1]
    return pixels if Image.MAX_IMAGE_PIXELS is not None and pixels > Image.MAX_IMAGE_PIXELS else 0


class Loaded(NamedTuple):
    """What a pipeline makes of one file (a Sample's makings)."""

    image: object  # a tensor, or for the gpu backend an Encoded
    file_bytes: int  # read from storage
    large_pixels: int = 0  # see large_pixels


def _eight_bit(image: Image.Image) -> Image.Image:
    """16-bit and 32-bit grayscale scaled to 8 bits: Pillow's convert("RGB")
    clips them at 255, which turns almost every pixel white."""
    if image.mode.startswith("I"):  # I;16, I;16B, I (what 16-bit PNG and TIFF files open as)
        pixels = np.asarray(image, dtype=np.float64) / 257.0  # 65535 -> 255
    elif image.mode == "F":  # float images: [0, 1] when they are fractions, else taken as 0..255
        pixels = np.asarray(image, dtype=np.float64)
        pixels = pixels * 255.0 if pixels.size and np.nanmax(pixels) <= 1.0 else pixels
    else:
        return image
    return Image.fromarray(np.clip(np.nan_to_num(pixels), 0, 255).round().astype(np.uint8), mode="L")


def _uint8_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB Pillow image as a 3 x H x W uint8 tensor, its pixels
    interleaved in memory (H x W x 3) as Pillow and decode_jpeg leave them."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


def stack_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """3 x H x W images as one N x 3 x H x W batch in channels-last memory
    (N x H x W x 3 underneath). The images come out of Geometry.apply in that
    layout on the CPU, so stacking them is a copy of whole images, where
    torch.stack's default NCHW batch would gather every byte: 5-10x slower,
    45-80 us an image at 224 px, 3-5% of the torchvision backend's time. The device
    then turns them into float batches in either memory format
    (DeviceInput). default_collate does the stacking: in a data-loading
    worker it builds the batch in shared memory."""
    return default_collate([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)


# The reference pipelines (--data-backend pil): Pillow all the way, float32 out of the worker.

def train_transform(image_size: int, crop_scale: Tuple[float, float] = (0.08, 1.0), hflip: float = 0.5):
    return transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=crop_scale, ratio=CROP_RATIO),
        transforms.RandomHorizontalFlip(hflip),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def val_transform(image_size: int, val_resize: int):
    return transforms.Compose([
        transforms.Resize(val_resize),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


class PILImages:
    """--data-backend pil: path -> (normalised float image, bytes read)."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, path: str) -> Loaded:
        image, file_bytes = read_rgb(path)
        return Loaded(self.transform(image), file_bytes, large_pixels(image.size))


# The fast pipelines: uint8 tensors, one geometry for every decoder.

@dataclasses.dataclass(frozen=True)
class JpegDecoder:
    """The library that decodes whole JPEGs into tensors on the torchvision
    and gpu backends: TorchCodec, torchvision.io (whose image decoders
    torchvision 0.29 deprecates in favour of TorchCodec's) or, where neither
    works, Pillow. Chosen once per run (choose_jpeg_decoder) and handed to
    the data-loading workers with their pipeline, so they neither probe nor
    warn; the run's header says which (describe) and config.json records it.
    All three are libjpeg-turbo underneath: the same pixels, and so the same
    crops (tests/test_decoders.py)."""

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
    expected = _uint8_tensor(decode_rgb(buffer.getvalue(), "<test JPEG>")).int()
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


def _tensor_decodable(image: Image.Image) -> bool:
    """A JPEG the tensor decoders read as Pillow does: 8-bit grayscale,
    colour or CMYK, stored upright. TorchCodec turns an image by its EXIF
    orientation, which Pillow and torchvision leave alone (as torchvision's
    ImageNet reference does): such files are Pillow's, so every backend cuts
    the same crop from the same pixels."""
    if image.format != "JPEG" or image.mode not in ("L", "RGB", "CMYK"):
        return False
    return "exif" not in image.info or image.getexif().get(EXIF_ORIENTATION, 1) == 1

@dataclasses.dataclass(frozen=True)
class Geometry:
    """What becomes of one image: the training crop box (in the full-size
    image's pixels) and flip, or, with `crop` None, validation's resize of
    the short side to `val_resize` and centre crop."""

    image_size: int
    crop: Optional[Tuple[int, int, int, int]] = None  # (top, left, height, width)
    flip: bool = False
    val_resize: int = 0

    def reduction(self, width: int, height: int) -> int:
        """The largest DCT scaling 1, 2, 4 or 8 that still leaves at least
        the output's pixels for the crop: libjpeg then skips the inverse DCT,
        upsampling and colour work of the pixels it does not produce (its
        entropy decoding, most of the time on photo-like files, stays)."""
        if self.crop is None:
            return 1  # validation decodes at full size, as the reference does: top-1 stays comparable
        for factor in (8, 4, 2):
            if min(self.crop[2], self.crop[3]) >= factor * self.image_size:
                return factor
        return 1

    def apply(self, image: torch.Tensor, full_width: int, full_height: int) -> torch.Tensor:
        """Crop, resize and flip a 3 x H x W uint8 image (on any device),
        which may be a 1/k-size decode of a full_width x full_height file."""
        size = [self.image_size, self.image_size]
        if self.crop is None:
            image = tensor_ops.resize(_interleaved(image.unsqueeze(0)), [self.val_resize], antialias=True)[0]
            return tensor_ops.center_crop(image, size)
        top, left, height, width = self.crop
        scale_y, scale_x = image.shape[-2] / full_height, image.shape[-1] / full_width
        if scale_x != 1.0 or scale_y != 1.0:  # a reduced decode: the same box, in its pixels
            top, left = int(round(top * scale_y)), int(round(left * scale_x))
            height = max(1, min(int(round(height * scale_y)), image.shape[-2] - top))
            width = max(1, min(int(round(width * scale_x)), image.shape[-1] - left))
        crop = _interleaved(image[..., top:top + height, left:left + width].unsqueeze(0))
        image = tensor_ops.resize(crop, size, antialias=True)[0]
        return tensor_ops.horizontal_flip(image) if self.flip else image


def _interleaved(images: torch.Tensor) -> torch.Tensor:
    """On the CPU, N x 3 x H x W as one channels-last block (a copy only
    where it is not one already: a crop's rows): the antialiased uint8
    resize has a vectorised CPU kernel for that layout, 1.2-1.5x faster than
    for planar channels, and its output keeps the layout (see
    stack_images). The CUDA kernel works on planar channels (it would copy
    a channels-last block back): GPU images stay as they are."""
    if images.device.type != "cpu":
        return images
    return images.contiguous(memory_format=torch.channels_last)


class TensorImages:
    """--data-backend torchvision: path -> (3 x S x S uint8 image, bytes
    read). With `train`, the crop and flip are drawn from torch's generator
    exactly as the reference's RandomResizedCrop and RandomHorizontalFlip
    draw them."""

    def __init__(self, train: bool, image_size: int, crop_scale: Sequence[float] = (0.08, 1.0),
                 hflip: float = 0.5, val_resize: int = 256, reduced_decode: bool = True,
                 decoder: Optional[JpegDecoder] = None):
        self.train = train
        self.image_size = image_size
        self.crop_scale = list(crop_scale)
        self.hflip = hflip
        self.val_resize = val_resize
        self.reduced_decode = reduced_decode
        self.decoder = decoder or choose_jpeg_decoder()  # None: chosen here (the training loaders pass theirs)

    def geometry(self, width: int, height: int) -> Geometry:
        if not self.train:
            return Geometry(self.image_size, val_resize=self.val_resize)
        # get_params reads only the shape of what it is given: a meta tensor has one and no memory
        shape_only = torch.empty((3, height, width), device="meta")
        box = transforms.RandomResizedCrop.get_params(shape_only, self.crop_scale, list(CROP_RATIO))
        flip = bool(torch.rand(1) < self.hflip)  # RandomHorizontalFlip's draw
        return Geometry(self.image_size, crop=box, flip=flip)

    def __call__(self, path: str) -> Loaded:
        return self.load(read_file(path), path)

    def load(self, encoded: bytes, path: str) -> Loaded:
        """The file's image from its bytes: the hand-read header where it
        will do, else Pillow's look at the file."""
        header = self.plain_header(encoded)
        if header is not None:
            image = self.finish(encoded, path, header.size, tensor_decodable=True)
            return Loaded(image, len(encoded), 0)
        with open_image(encoded, path) as opened:
            image = self.finish(encoded, path, opened.size, _tensor_decodable(opened), opened)
            return Loaded(image, len(encoded), large_pixels(opened.size))

    def plain_header(self, encoded: bytes) -> Optional[JpegHeader]:
        """The hand-read header of a JPEG that needs no look from Pillow, else
        None: not a JPEG (or an odd one), an image above Pillow's
        decompression-bomb limit (Pillow refuses those above twice it), or one
        with EXIF that the decoder would turn by its orientation."""
        header = jpeg_header(encoded)
        if header is None or large_pixels(header.size) or (header.exif and self.decoder.name == "torchcodec"):
            return None
        return header

    def finish(self, encoded: bytes, path: str, size: Tuple[int, int], tensor_decodable: bool,
               opened: Optional[Image.Image] = None) -> torch.Tensor:
        """The file's training or validation image (3 x S x S uint8), from
        its bytes and size; `opened`: Pillow's look at it, when it had one."""
        width, height = size
        geometry = self.geometry(width, height)
        factor = geometry.reduction(width, height) if self.reduced_decode else 1
        decoded = None
        if factor == 1 and tensor_decodable and self.decoder.makes_tensors:
            decoded = self.decoder.decode_or_none(encoded)
        if decoded is None:  # reduced, not a JPEG, or what the decoder refused: Pillow's (the same libjpeg)
            draft = (width // factor, height // factor) if factor > 1 else None
            rgb = load_rgb(opened, encoded, path, draft) if opened is not None else decode_rgb(encoded, path, draft)
            decoded = _uint8_tensor(rgb)
        return geometry.apply(decoded, width, height)


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


# --data-backend gpu: the worker sends the file and its geometry, the device decodes.

@dataclasses.dataclass
class Encoded:
    """One image as a worker of the gpu backend hands it over: the JPEG's
    bytes and geometry, or (files nvJPEG should not get) the finished uint8 image."""

    data: Optional[torch.Tensor]  # the file's bytes, uint8
    geometry: Optional[Geometry]
    size: Tuple[int, int] = (0, 0)  # (width, height) of the file
    path: str = ""
    image: Optional[torch.Tensor] = None  # finished on the CPU
    decoder: Optional[JpegDecoder] = None  # the run's, for the JPEG


class EncodedImages(TensorImages):
    """--data-backend gpu: path -> Loaded(Encoded, bytes read, ...). Only
    complete, upright RGB and grayscale JPEGs (an end marker) go to the GPU:
    a truncated file meets Pillow in the worker, where --bad-images decides
    about it, and CMYK, which nvJPEG does not convert, is finished in the
    worker; so is everything when the chosen decoder is Pillow's."""

    device_decodes_with_run_decoder = True  # the GPU decodes with the run's JpegDecoder (needs a tensor one)

    def __call__(self, path: str) -> Loaded:
        encoded = read_file(path)
        header = self.plain_header(encoded)
        cannot_decode = self.device_decodes_with_run_decoder and not self.decoder.makes_tensors
        if (header is None or cannot_decode or header.mode not in ("RGB", "L")
                or not encoded.rstrip(b"\0").endswith(JPEG_END)):
            finished, file_bytes, large = self.load(encoded, path)
            return Loaded(Encoded(None, None, image=finished), file_bytes, large)
        data = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        return Loaded(Encoded(data, self.geometry(*header.size), header.size, path, decoder=self.decoder),
                      len(encoded), 0)


class DaliImages(EncodedImages):
    """--data-backend dali: what the gpu backend's workers hand over, the
    same files as JPEGs whatever the run's decoder (DALI decodes them on the
    device: common.dali); the run's decoder finishes the others in the worker."""

    device_decodes_with_run_decoder = False


class EncodedBatch:
    """A batch of Encoded images in two tensors, built by collate in the
    worker: the JPEG files end to end, and the images finished on the CPU
    stacked. A worker's tensors reach the training process as shared-memory
    segments that each hold a file descriptor while in flight: one per image
    would run into the open-file limit at batch 256 with a few workers."""

    def __init__(self, items: List[Encoded]):
        jpegs = [item for item in items if item.image is None]
        self.decoder = jpegs[0].decoder if jpegs else None
        self.is_jpeg = [item.image is None for item in items]
        self.data = torch.cat([item.data for item in jpegs]) if jpegs else torch.empty(0, dtype=torch.uint8)
        self.lengths = [len(item.data) for item in jpegs]
        self.geometries = [item.geometry for item in jpegs]
        self.sizes = [item.size for item in jpegs]
        self.paths = [item.path for item in jpegs]
        finished = [item.image for item in items if item.image is not None]
        self.finished = stack_images(finished) if finished else None

    def __len__(self) -> int:
        return len(self.is_jpeg)

    def decode(self, device: torch.device, dali=None) -> torch.Tensor:
        """The batch as N x 3 x S x S uint8 on `device`: its JPEGs decoded
        there, by `dali` (a common.dali.DaliDecoder) when given, else in one
        call to the run's decoder (nvJPEG on a GPU) and cropped and resized
        there; its other images were finished in the worker."""
        if dali is not None and self.finished is None and self.lengths:
            return dali.decode(self)  # all JPEGs: DALI's batch as it is, no copy
        if not self.lengths:
            decoded = iter(())
        else:
            decoded = iter(dali.decode(self) if dali is not None else self.decode_jpegs(device))
        finished = iter(self.finished.to(device, non_blocking=True) if self.finished is not None else ())
        return stack_images([next(decoded) if is_jpeg else next(finished) for is_jpeg in self.is_jpeg])

    def decode_jpegs(self, device: torch.device) -> List[torch.Tensor]:
        """The batch's JPEGs decoded by the run's decoder on `device` (one
        call), then cropped, resized and flipped there."""
        files = list(torch.split(self.data, self.lengths))
        return [geometry.apply(image, *size) for image, geometry, size in
                zip(_decode_on(self.decoder, device, files, self.paths), self.geometries, self.sizes)]


def _decode_on(decoder: JpegDecoder, device: torch.device, files: List[torch.Tensor],
               paths: List[str]) -> List[torch.Tensor]:
    if not files:
        return []
    if device.type == "cuda":
        # nvJPEG (torchvision's, at least) writes its outputs from a stream of its own, without waiting
        # for this one: memory this stream freed but still has queued work on must be finished with first.
        torch.cuda.current_stream(device).synchronize()
    try:
        return decoder.decode(files, device)
    except Exception as error:  # one file the device's decoder refuses fails the batch: one at a time, Pillow last
        warnings.warn(f"the {device.type.upper()} JPEG decoder refused a batch ({error_summary(error)}); its files are "
                      f"decoded one at a time, any it refuses by Pillow in the training process (slower)",
                      GPUDecodeFallback, stacklevel=2)
        decoded = []
        for data, path in zip(files, paths):
            try:
                decoded.append(decoder.decode(data, device))
            except Exception:
                decoded.append(_uint8_tensor(_decode_late(data.numpy().tobytes(), path)).to(device))
        return decoded


class GPUDecodeFallback(RuntimeWarning):
    """nvJPEG refused a batch: the gpu backend went the slow way for it."""


def _decode_late(encoded: bytes, path: str) -> Image.Image:
    """Pillow's decode of a JPEG the GPU refused: past the workers, where
    --bad-images skip could have put another image in its place."""
    try:
        return decode_rgb(encoded, path)
    except BadImageError as error:
        raise BadImageError(f"{path}: cannot decode image ({error.reason}); with --data-backend gpu or dali this "
                            f"shows only when the batch is decoded, too late for --bad-images skip: remove or "
                            f"replace the file, or use --data-backend torchvision", reason=error.reason) from None


# On the device: uint8 -> normalised float, memory format, prefetching.

class DeviceInput:
    """Batches as the model takes them: on `device`, float32, normalised
    with the ImageNet mean and std, in the model's memory format. uint8
    batches (torchvision and gpu backends) are converted here, on the
    device, rather than in every worker; float batches (pil, already
    normalised) only move. On a GPU, the next batch is copied (from pinned
    memory), decoded and normalised on a side stream while the current step
    runs; the training step never waits for the host except for the data."""

    def __init__(self, device: torch.device, channels_last: bool = False):
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        shape = (1, 3, 1, 1)
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).mul_(255.0).reshape(shape)
        self.inverse_std = torch.tensor(IMAGENET_STD, device=device).mul_(255.0).reciprocal_().reshape(shape)

    def images(self, images, dali=None) -> torch.Tensor:
        """One batch's images on the device, ready for the model. `dali`:
        the run's common.dali.DaliDecoder, for --data-backend dali."""
        if isinstance(images, EncodedBatch):
            images = images.decode(self.device, dali)
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.to(torch.float32, memory_format=self.memory_format).sub_(self.mean).mul_(self.inverse_std)
        return images.contiguous(memory_format=self.memory_format)

    def batch(self, batch, dali=None):
        return batch._replace(image=self.images(batch.image, dali),
                              target=batch.target.to(self.device, non_blocking=True))

    def __call__(self, batches: Iterable, dali=None) -> Iterator:
        """The batches of `batches` (Samples), finished on the device (by
        `dali` for --data-backend dali: see images)."""
        if self.device.type != "cuda":
            for batch in batches:
                yield self.batch(batch, dali)
            return
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the mean and std were made on the current stream
        batches = iter(batches)

        def prepare(batch):
            if batch is None:
                return None
            with torch.cuda.stream(stream):
                return self.batch(batch, dali)

        upcoming = prepare(next(batches, None))
        while upcoming is not None:
            current.wait_stream(stream)
            ready = upcoming
            # Made on the side stream, used on the current one: their memory must not be reused
            # before the current stream is done with them.
            ready.image.record_stream(current)
            ready.target.record_stream(current)
            upcoming = prepare(next(batches, None))
            yield ready


def normalize(images: torch.Tensor) -> torch.Tensor:
    """A uint8 batch (or image) as the model takes it, on its own device (for
    tools and tests: training uses DeviceInput)."""
    single = images.dim() == 3
    finished = DeviceInput(images.device).images(images.unsqueeze(0) if single else images)
    return finished[0] if single else finished

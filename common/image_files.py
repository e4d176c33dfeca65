"""Image files: reading one, Pillow's decode of any image to 8-bit RGB, and
the bad images.

Every backend reads files with read_file and falls back on Pillow for what
its faster decoder does not take (other formats, odd JPEGs), so they all
call the same files unreadable, with Pillow's reason: BadImageError, a
UsageError that names the file (--bad-images decides what the run does).

Images above Pillow's decompression-bomb limit are noted (large_pixels,
pipelines.Loaded.large_pixels) instead of letting Pillow warn without naming
them: the training loop counts them and names one, once (data.BadImages).
"""
from __future__ import annotations

import io
import warnings
from typing import Optional, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from common.errors import UsageError, error_summary

# Pillow warns about harmless oddities it decodes anyway (corrupt EXIF blocks, which some ImageNet
# JPEGs have; palette transparency), once per data-loading worker and epoch: noise in a long log.
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")


class BadImageError(UsageError):
    """An image file that cannot be decoded; the message names the file."""

    rank_specific = True  # only the process whose share holds the file meets it

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)  # rebuilt by a DataLoader from a worker's: one line (ReportedError.raised_in_worker)
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


def uint8_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB Pillow image as a 3 x H x W uint8 tensor, its pixels
    interleaved in memory (H x W x 3) as Pillow and decode_jpeg leave them."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)

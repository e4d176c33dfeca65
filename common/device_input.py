"""On the device: batches as the model takes them.

DeviceInput moves each batch to the device and finishes it there: the gpu
and dali backends' EncodedBatch (collated in the data-loading worker: the
JPEG files end to end) is decoded there, by the run's JpegDecoder (nvJPEG on
a GPU; a batch it refuses goes one file at a time, Pillow last:
GPUDecodeFallback) or by DALI (common.dali: its pipeline fed batches ahead of the one the step
takes); uint8 becomes normalised float32
in the model's memory format. On a GPU it prepares the next batch on a side
stream while the current step runs.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Iterator, List

import torch
from PIL import Image

from common.errors import error_summary
from common.image_files import BadImageError, decode_rgb, uint8_tensor
from common.jpeg_decoders import JpegDecoder
from common.pipelines import IMAGENET_MEAN, IMAGENET_STD, Encoded, replayed, stack_images


# --data-backend gpu and dali: the workers' files, collated into one batch, decoded on the device.

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
        # --auto-augment, --random-erase: the run's transforms, and each JPEG's generator state to draw them from
        self.augment = jpegs[0].augment if jpegs else None
        self.generator_states = torch.stack([item.generator_state for item in jpegs]) if self.augment else None
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
        call), then cropped, resized and flipped there, and augmented with
        the draws their workers would have made (pipelines.replayed)."""
        files = list(torch.split(self.data, self.lengths))
        images = [geometry.apply(image, *size) for image, geometry, size in
                  zip(_decode_on(self.decoder, device, files, self.paths), self.geometries, self.sizes)]
        if self.augment is None:
            return images
        return [replayed(self.augment, image, state) for image, state in zip(images, self.generator_states)]


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
                decoded.append(uint8_tensor(_decode_late(data.numpy().tobytes(), path)).to(device))
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
        if dali is not None:  # DALI decodes the next batches in its threads while this one is used
            batches = dali.ahead(batches)
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

"""--data-backend dali: NVIDIA DALI decodes each batch's JPEGs on the device.

Only the decode changes hands. The data-loading workers do what they do for
--data-backend gpu (pipelines.DaliImages, an EncodedImages): read each file
in this project's sampler order, read its header, draw its crop and flip
from the image's own seed, and hand over the bytes; files DALI should not
get (not a complete upright RGB or grayscale JPEG: PNG, CMYK, truncated, ...)
are finished in the worker, where --bad-images decides about the unreadable
ones. So each process gets exactly the images, in exactly the order, of
--data-backend torchvision: mid-epoch resume, --bad-images, the bytes read
and the per-class report work as they do there.

In the training process, one DALI pipeline (DaliDecoder) takes the batch's
files through DALI's external source and, on a GPU (device "mixed"), decodes
them with the GPU's hardware JPEG decoder where it has one (A100, H100,
...) and nvJPEG's CUDA decoder otherwise, decoding only the crop's region
of each file (ROI decoding), then resizes to S x S and flips, and hands the
uint8 batch over on the GPU (no host round trip); DeviceInput normalises it
and sets the model's memory format there, as for every backend. On the CPU
(device "cpu": libjpeg-turbo in DALI's own threads) the same pipeline runs,
which is what the tests use. The crop boxes and flips are the project's own,
so DALI cuts the same boxes as the other backends (a resumed run equals an
uninterrupted one); only the resampling arithmetic differs (DALI's
antialiased linear resize; tests/e2e/test_dali.py bounds the difference).
Validation decodes whole files, resizes the short side to --val-resize and
cuts the centre crop, as the other backends do, in one resize of that region.
The output side comes with each image (its Geometry's): one pipeline serves
the validation crop (--val-crop-size) and every training crop of
--progressive-resizing.
The pipeline runs ahead of the step (DaliDecoder.ahead, which DeviceInput
puts between the loader and the step): each batch is fed to DALI, and its
decode scheduled in DALI's threads, AHEAD_BATCHES - 1 batches before the step
takes it, so it decodes while the steps before it run; the training thread
only feeds and collects. The batches stay in their order (DALI's outputs come
in the order of their runs), and one DALI refuses is decoded as before (a
new pipeline gets those fed after it again).
Its threads end before the training process forks a data-loading worker
(end_threads: a lock one of them held would stay held in the child for
good), and the next batch builds the pipeline again.

DALI is optional (requirements-dali.txt): this module imports it only when a
DaliDecoder is made, and a missing package is one line naming the package
that matches the installed PyTorch's CUDA.
"""
from __future__ import annotations

import collections
import importlib
import warnings
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from common.errors import UsageError, error_summary
from common.device_input import EncodedBatch, GPUDecodeFallback
from common.pipelines import Geometry, stack_images

DALI_REQUIREMENTS = "requirements-dali.txt"
DALI_TESTED = "2.4"  # the oldest DALI this backend was run with (requirements-dali.txt)
# Batches DALI may refuse in a row (each decoded on the CPU instead) before the run stops: more than a
# stray damaged file, DALI's decoder itself failing here.
MAX_REFUSED_IN_A_ROW = 3
# Batches in DALI at once while a run iterates (DaliDecoder.ahead): the one the step takes next and the one
# after it, which decodes in DALI's threads during that step. On a GPU DeviceInput prepares one batch ahead
# on top (a collected one), so DALI then has a whole step to decode each batch.
AHEAD_BATCHES = 2


def dali_package() -> str:
    """The DALI wheel built for this PyTorch's CUDA major version
    (nvidia-dali-cuda120 for CUDA 12.x, nvidia-dali-cuda130 for 13.x); a
    CPU-only PyTorch can take any: the newest."""
    major = (torch.version.cuda or "13").split(".")[0]
    return f"nvidia-dali-cuda{major}0"


def import_failure() -> Optional[Exception]:
    """What importing nvidia.dali raises here, None when it imports (the
    bench asks this too, to say why a dali row has no figures)."""
    try:
        importlib.import_module("nvidia.dali")
    except Exception as error:  # a broken or mismatched wheel fails in many ways: ImportError, OSError, ...
        return error
    return None


def not_installed(error: Exception) -> bool:
    """import_failure's error means DALI is missing (not a dependency of it:
    that is a broken install)."""
    return isinstance(error, ModuleNotFoundError) and error.name in ("nvidia", "nvidia.dali")


def import_dali():
    """nvidia.dali, or a UsageError saying what to install."""
    error = import_failure()
    if error is None:
        return importlib.import_module("nvidia.dali")
    reason = "not installed" if not_installed(error) else f"it does not import: {error_summary(error, limit=160)}"
    cuda = f" for this PyTorch's CUDA {torch.version.cuda}" if torch.version.cuda else ""
    raise UsageError(f"argument --data-backend: dali needs NVIDIA DALI ({reason}): pip install "
                     f"'{dali_package()}>={DALI_TESTED}'{cuda} (pip install -r {DALI_REQUIREMENTS} for CUDA 13)")


class DaliFailing(UsageError):
    """DALI's decoder refuses batch after batch on this process: not a file's fault."""

    rank_specific = True  # met by the process whose batches it is


def windows(geometry: Geometry, width: int, height: int) -> Tuple[List[float], List[float]]:
    """Where one output image comes from in a width x height file: the box
    DALI decodes, as (x, y, width, height), and the region of that box the
    resize maps onto S x S, as (y0, x0, y1, x1) in the box's pixels (fractions
    allowed). Training: the crop box, all of it. Validation: the whole file,
    and the region that resizing the short side to val_resize (torchvision's
    rounding) and cutting the centre S x S keeps."""
    if geometry.crop is not None:
        top, left, crop_height, crop_width = geometry.crop
        return [left, top, crop_width, crop_height], [0.0, 0.0, crop_height, crop_width]
    size, short, long = geometry.image_size, min(width, height), max(width, height)
    resized_long = int(geometry.val_resize * long / short)
    resized_width, resized_height = ((geometry.val_resize, resized_long) if width <= height
                                     else (resized_long, geometry.val_resize))
    top, left = int(round((resized_height - size) / 2.0)), int(round((resized_width - size) / 2.0))
    scale_y, scale_x = height / resized_height, width / resized_width
    return [0, 0, width, height], [top * scale_y, left * scale_x, (top + size) * scale_y, (left + size) * scale_x]


class DaliDecoder:
    """The DALI pipeline of one training process: decode(batch) makes the
    batch's JPEGs N x 3 x S x S uint8 images on the device. Built when made,
    in the training process (a pipeline cannot be pickled to another), so a
    DALI that cannot build it here says so before any data is read. A file
    DALI refuses (a JPEG damaged inside, which the workers' header check
    cannot see) leaves its pipeline unusable: that batch is then decoded on
    the CPU in this process (Pillow names a file it cannot read either), a
    warning says so once, and the next batch gets a new pipeline;
    MAX_REFUSED_IN_A_ROW batches refused in a row stop the run.

    On a GPU the chroma planes are upsampled the hardware decoder's way
    unless `libjpeg_chroma` asks for libjpeg's ("fancy", Pillow's): on one
    H200 (2026-11-26, bench end-to-end, ResNet-50 O2) libjpeg's way gave
    2,273 images/s (median of 2) and the default 3,298 (one run), which is
    what keeping the hardware JPEG engines out would cost. Pixels then differ
    from the CPU decoders' at colour edges; the crops' geometry does not.
    One class: the pipeline, the batches in flight and those it holds change together."""

    def __init__(self, device: torch.device, max_batch: int, threads: int, libjpeg_chroma: bool = False,
                 ahead: int = AHEAD_BATCHES):
        self.dali = import_dali()
        self.device = device
        self.max_batch = max_batch
        self.threads = max(1, threads)
        self.on_gpu = device.type == "cuda"
        self.libjpeg_chroma = libjpeg_chroma
        self.ahead_batches = max(1, ahead)
        self.refused_in_a_row = 0
        self.batches_fed = 0  # runs scheduled over this decoder's life (a batch fed again after a refusal counts again)
        self._in_flight: collections.deque = collections.deque()  # batches fed, their images not yet taken, in order
        self._scheduled = 0  # how many of them (the first) the current pipeline holds
        self._warned = False
        self._pipeline = self._built()  # now: a DALI that cannot build it here says so before any data is read

    @property
    def batches_in_flight(self) -> int:
        """Batches fed to DALI whose images are not taken yet."""
        return len(self._in_flight)

    @property
    def version(self) -> str:
        return self.dali.__version__

    def describe(self) -> str:
        """One line for the run's header."""
        where = ("on the GPU: its hardware JPEG decoder where it has one, else nvJPEG" if self.on_gpu
                 else "on the CPU: libjpeg-turbo")
        return (f"DALI {self.version} decodes the JPEGs {where}, each crop's region only, in {self.threads} "
                f"thread(s), {self.ahead_batches} batches in flight; other files are finished in the data-loading "
                f"workers")

    def to_dict(self) -> dict:
        return {"version": self.version, "device": "mixed" if self.on_gpu else "cpu", "threads": self.threads,
                "libjpeg_chroma": self.libjpeg_chroma, "ahead_batches": self.ahead_batches}

    def _built(self):
        try:
            return build_pipeline(self.dali, self.device, self.max_batch, self.threads, self.libjpeg_chroma)
        except Exception as error:  # an older DALI's API, no usable GPU for it, ...
            raise UsageError(f"argument --data-backend: NVIDIA DALI {self.version} cannot build its decoding pipeline "
                             f"on {self.device} ({error_summary(error, limit=200)}); this backend was tested with "
                             f"DALI {DALI_TESTED} (pip install -U '{dali_package()}>={DALI_TESTED}'), or use "
                             f"--data-backend torchvision") from None

    def end_threads(self) -> None:
        """End the pipeline's threads (executor, thread pool, input workers):
        the training process calls this before it forks each data-loading
        worker (build_loaders' multiprocessing context), and the next decode
        builds the pipeline again (milliseconds on the CPU; twice an epoch, in
        the first step of training and of validation), feeding it again any
        batch fed to this one. A child forked while one of DALI's threads held
        a lock (DALI's, libstdc++'s, the loader's) would find it held for good,
        by a thread it does not have."""
        self._pipeline = None  # its last reference: DALI's destructor stops and joins its threads
        self._scheduled = 0

    def ahead(self, samples: Iterable) -> Iterator:
        """The samples of `samples` (data.Sample) in their order, each given
        once the JPEGs of the next ahead_batches - 1 are fed to DALI and
        their decode scheduled: DALI decodes them in its threads while the
        caller uses this one (decode takes its images). Left early (a stop,
        an error), what it fed is dropped."""
        waiting: collections.deque = collections.deque()
        try:
            for sample in samples:
                if isinstance(sample.image, EncodedBatch) and sample.image.lengths:
                    self.submit(sample.image)
                waiting.append(sample)
                if len(waiting) >= self.ahead_batches:
                    yield waiting.popleft()
            while waiting:
                yield waiting.popleft()
        finally:  # its own batches only: another pass's, fed meanwhile, stay in flight
            self.drop([sample.image for sample in waiting])

    def submit(self, batch: EncodedBatch) -> None:
        """Feed `batch`'s JPEGs to DALI and schedule their decode, after the
        batches already in flight; decode(batch) takes the images."""
        self._in_flight.append(batch)
        if self._pipeline is None:
            self._pipeline = self._built()
        self._schedule_in_flight()

    def drop(self, batches: List[EncodedBatch]) -> None:
        """Forget those of `batches` in flight, and the pipeline that holds them (a new one is fed the rest)."""
        kept = [fed for fed in self._in_flight if not any(fed is batch for batch in batches)]
        if len(kept) < len(self._in_flight):
            self._in_flight = collections.deque(kept)
            self.end_threads()

    def _schedule_in_flight(self) -> None:
        """Feed the current pipeline the batches in flight it does not hold yet (all of them, in order, after
        a refusal or end_threads made a new one)."""
        while self._scheduled < len(self._in_flight):
            feed_pipeline(self._pipeline, self._in_flight[self._scheduled])
            self._pipeline.schedule_run()
            self._scheduled += 1
            self.batches_fed += 1

    def decode(self, batch: EncodedBatch) -> torch.Tensor:
        """The batch's JPEGs (those it holds as files), cropped, resized and
        flipped, as N x 3 x S x S uint8 on the device, channels-last in memory:
        the images of the batch first in flight (ahead), or of `batch` fed now."""
        if not (self._in_flight and self._in_flight[0] is batch):
            # Those fed before it, for a pass that was left, go; those after it stay (else each later batch of
            # this pass would be missing in turn: fed twice, a pipeline built for each). Not fed ahead: all go.
            position = next((index for index, fed in enumerate(self._in_flight) if fed is batch), None)
            self.drop(list(self._in_flight)[:position])
            if position is None:
                self._in_flight.append(batch)
        if self._pipeline is None:
            self._pipeline = self._built()
        try:
            self._schedule_in_flight()
            self._in_flight.popleft()  # this batch: DALI's outputs come in the order of its runs
            self._scheduled -= 1
            images = pipeline_images(self._pipeline, self.device)
        except Exception as error:  # DALI's error for a file it cannot decode; its pipeline is unusable now
            if self._in_flight and self._in_flight[0] is batch:  # failed feeding, before its images were asked for
                self._in_flight.popleft()
            self.end_threads()  # the batches after this one are fed again to the next pipeline
            self.refused_in_a_row += 1
            if self.refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
                self.drop(list(self._in_flight))
                raise DaliFailing(f"argument --data-backend: DALI refused {self.refused_in_a_row} batches in a row "
                                  f"(the last: {error_summary(error, limit=200)}): its decoder does not work here; "
                                  f"use --data-backend torchvision") from None
            if not self._warned:
                self._warned = True
                warnings.warn(f"DALI refused a batch ({error_summary(error, limit=200)}); such batches are decoded "
                              f"on the CPU in the training process (slower)", GPUDecodeFallback, stacklevel=2)
            return stack_images(batch.decode_jpegs(torch.device("cpu"))).to(self.device)
        self.refused_in_a_row = 0
        return images


def build_pipeline(dali, device: torch.device, max_batch: int, threads: int, libjpeg_chroma: bool,
                   hw_decoder_load: Optional[float] = None):
    """The decoding pipeline (DaliDecoder's) for `device`: batches of up to `max_batch` files in, N x S x S x 3
    uint8 images out (fed: feed_pipeline; taken: pipeline_images). `hw_decoder_load`: the share of each batch
    the GPU's hardware JPEG decoder takes (DALI's default where None; the bench's decode section varies it)."""
    on_gpu = device.type == "cuda"
    fn, types = importlib.import_module("nvidia.dali.fn"), importlib.import_module("nvidia.dali.types")
    device_id = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None
    # The dynamic executor (DALI 2.4's default; asked for, for older ones) hands outputs over on the
    # caller's CUDA stream, and queues every scheduled run, however many wait (exec2's Run: a queue of
    # pending outputs, no bound): a queue depth of 1 only keeps its first schedule_run to one run (a
    # deeper one runs that many at once, each needing its batch fed already); ahead() decides how many
    # batches are in flight.
    pipeline = dali.Pipeline(batch_size=max_batch, num_threads=threads, device_id=device_id, prefetch_queue_depth=1,
                             exec_dynamic=True)
    decode_options = dict(device="mixed" if on_gpu else "cpu", output_type=types.RGB, axis_names="WH",
                          normalized_anchor=False, normalized_shape=False)
    if on_gpu and libjpeg_chroma:  # the CPU decoder's chroma upsampling: Pillow's pixels, slower
        decode_options["jpeg_fancy_upsampling"] = True
    if on_gpu and hw_decoder_load is not None:
        decode_options["hw_decoder_load"] = hw_decoder_load
    if importlib.import_module("nvidia.dali.backend").GetSchema("decoders__ImageSlice").HasArgument(
            "adjust_orientation"):
        decode_options["adjust_orientation"] = False  # stored pixels, as Pillow and the reference read them
    with pipeline:
        files = fn.external_source(name="files", dtype=types.UINT8, ndim=1)
        box = fn.external_source(name="box", dtype=types.FLOAT, ndim=1)  # x, y, width, height
        region = fn.external_source(name="region", dtype=types.FLOAT, ndim=1)  # y0, x0, y1, x1 in the box
        flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
        # The output side, per image (from its Geometry): the training crop of the epoch
        # (--progressive-resizing) or the validation crop, one pipeline for every size.
        size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)
        images = fn.decoders.image_slice(files, box[0:2], box[2:4], **decode_options)
        images = fn.resize(images, size=size, roi_start=region[0:2], roi_end=region[2:4], antialias=True)
        pipeline.set_outputs(fn.flip(images, horizontal=flip))
    pipeline.build()
    return pipeline


def feed_pipeline(pipeline, batch: EncodedBatch) -> None:
    """Feed `batch`'s JPEG files, crop windows, flips and output sizes to `pipeline`'s external sources."""
    data = batch.data.numpy()
    ends = np.cumsum(batch.lengths)
    boxes, regions = zip(*(windows(geometry, *size) for geometry, size in zip(batch.geometries, batch.sizes)))
    pipeline.feed_input("files", [data[end - length:end] for end, length in zip(ends, batch.lengths)])
    pipeline.feed_input("box", [np.asarray(box, dtype=np.float32) for box in boxes])
    pipeline.feed_input("region", [np.asarray(region, dtype=np.float32) for region in regions])
    pipeline.feed_input("flip", [np.asarray(int(geometry.flip), dtype=np.int32) for geometry in batch.geometries])
    pipeline.feed_input("size", [np.asarray([geometry.image_size] * 2, dtype=np.float32)
                                 for geometry in batch.geometries])


def pipeline_images(pipeline, device: torch.device) -> torch.Tensor:
    """The images of `pipeline`'s oldest run not yet taken (waiting for them if need be), as N x 3 x S x S uint8
    on `device` (channels-last in memory), on its current CUDA stream on a GPU."""
    plugin = importlib.import_module("nvidia.dali.plugin.pytorch")
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    (output,) = pipeline.outputs(stream.cuda_stream) if stream is not None else pipeline.outputs()
    output = output.as_tensor()
    images = torch.empty(output.shape(), dtype=torch.uint8, device=device)  # N x S x S x 3
    plugin.feed_ndarray(output, images, cuda_stream=stream)
    return images.permute(0, 3, 1, 2)

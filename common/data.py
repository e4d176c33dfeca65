"""Input pipelines: datasets of image files and of synthetic tensors,
samplers and loaders. Which files a dataset holds (DATA/train/<class>/<image>
and DATA/val/<class>/<image>, scanned, cached or listed) is common.dataset_lists'.

What the files really are decides, not their names: a PNG named .JPEG,
CMYK, grayscale, palette, RGBA and 16-bit images all become 8-bit RGB. An
image file that cannot be decoded follows --bad-images: `fail` stops the run
at once naming the file (a multi-hour run must neither crash later with an
anonymous worker traceback nor hang); `skip` puts the next readable image of
the dataset in its place (in training; validation leaves it out), the same in
every process and epoch, and the training loop counts and lists it.

Reproducibility, which makes a resumed run equal an uninterrupted one: an
epoch's order is one permutation of the training set, a function of (seed,
epoch), cut into consecutive global batches whatever the world size
(TrainSampler); each image's random crop and flip are drawn from a seed of
its own, (seed, epoch, image index), so they do not depend on which process
or data-loading worker reads it, nor on how many there are. A checkpoint
taken mid-epoch records how many images of the permutation were used, and
the resumed epoch starts right after them. Repeated augmentation
(--ra-sampler: RepeatedAugmentationSampler) repeats each image of that
permutation K times, the copies seeded (seed, epoch, image index, copy); the
training crop's size under --progressive-resizing is a function of the epoch
(EpochPipelines): the same on resume.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import PIL
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data import default_collate

from common.arguments import check_fits_in_memory, memory_bytes
from common.augment import ImageAugmentation
from common.config import Config, CropSizes
from common.distributed import Context, gather_to_primary
from common.errors import UsageError
from common.dataset_lists import FileList, ImageFiles, find_lists
from common.shards import ShardedSplit, is_sharded, open_sharded
from common.launcher import oversubscription
from common.process_signals import data_loader_context, data_loader_worker_init
from common.dali import DaliDecoder
from common.data_timeout import ReadingSlots, batches
from common.device_input import EncodedBatch
from common.image_files import BadImageError
from common.jpeg_decoders import JpegDecoder, choose_jpeg_decoder
from common.pipelines import (DaliImages, EncodedImages, PILImages, TensorImages, stack_images, train_transform,
                              val_transform)

IMAGENET_TRAIN_IMAGES = 1_281_167  # ImageNet-1k, so --synthetic epochs have its length
SYNTHETIC_CLASSES = 1000
SYNTHETIC_VAL_BATCHES = 10  # per process: random tensors have no accuracy worth a full pass


class Sample(NamedTuple):
    """One training or validation sample; the DataLoader collates a batch of
    them into the same shape, with tensors (collate). `image` is a 3 x S x S
    uint8 tensor (torchvision backend, synthetic data), a normalised float
    one (pil) or the file for the GPU to decode (gpu; an EncodedBatch once
    collated): common.device_input.DeviceInput finishes each on the device.
    `file_bytes` is what reading the image took from storage (0 for
    synthetic data): summed over a split and over processes it is the exact
    volume the input pipeline read."""

    image: torch.Tensor
    target: int
    file_bytes: int
    # --bad-images skip: the dataset index of the unreadable file this sample stands in for, and why
    # it could not be read; -1 and "" for a sample that is itself.
    bad_index: int = -1
    bad_reason: str = ""
    # This image's dataset index when it is above Pillow's decompression-bomb limit (image_files.large_pixels):
    # counted and one named by the training loop (BadImages), instead of Pillow's anonymous warning.
    large_index: int = -1
    # Where file_bytes came from (common.storage.Fetched): bytes pulled from DATA's storage for this sample (for a
    # sharded dataset behind --data-cache, a whole shard copied into the cache on its first read), and bytes
    # read from the node-local cache. Image files and uncached shards: all of it from the source.
    source_bytes: int = 0
    cache_bytes: int = 0


def image_and_copy(key) -> Tuple[int, int]:
    """A training set's key: a dataset index, or (index, copy) from
    RepeatedAugmentationSampler (the copy-th time the epoch trains on it)."""
    return key if isinstance(key, tuple) else (key, 0)


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, epoch, index, ...): a hash, so
    neighbouring tuples get unrelated random streams."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ImageFolderDataset(Dataset):
    """(image, class index) for a list of (path, class index), or for a
    split of a sharded dataset (common.shards.ShardedSplit); `pipeline` turns
    an image's bytes and name into (image, bytes read) (see
    common.pipelines: from_bytes).

    With `augmentation_seed` set (training), the random crop and flip of
    image `index` in epoch `epoch` draw from derived_seed(augmentation_seed,
    epoch, index): the same crop in whichever process or worker reads it.
    Key (index, copy) (repeated augmentation) draws copy c > 0 from
    derived_seed(augmentation_seed, epoch, index, c): each copy its own crop.
    `pipeline_of_epoch` (--progressive-resizing: EpochPipelines), when given,
    is the pipeline of each epoch, in place of `pipeline`.

    With `skip_bad_images`, an unreadable file's sample is the next readable
    image after it (cyclically), transformed with the unreadable index's own
    seed and marked with that index: a function of the dataset alone, so every
    process and epoch makes the same replacement and batches keep their size.

    `workers`: the data-loading workers of its loaders, each of which notes
    the file it is reading (`reading`: data_timeout.ReadingSlots) for a
    batch that does not come within --data-timeout to name."""

    def __init__(self, samples: Sequence[Tuple[str, int]], pipeline: Callable, augmentation_seed: Optional[int] = None,
                 skip_bad_images: bool = False, workers: int = 0,
                 pipeline_of_epoch: Optional[Callable[[int], Callable]] = None):
        if isinstance(samples, ShardedSplit):
            self.samples, self.reader = samples, samples
        else:
            self.samples = samples if isinstance(samples, FileList) else FileList(samples)  # no per-sample objects
            self.reader = ImageFiles(self.samples)
        self.pipeline = pipeline
        self.pipeline_of_epoch = pipeline_of_epoch
        self.augmentation_seed = augmentation_seed
        self.skip_bad_images = skip_bad_images
        self.known_bad = set()  # indices of unreadable files met by this process or worker (see _next_readable)
        self.epoch = 0  # set by Loaders.set_epoch; data-loading workers get a copy when an epoch's iteration starts
        self.reading = ReadingSlots(workers)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key) -> Sample:
        index, copy = image_and_copy(key)
        bad_index, bad_reason, large_index = -1, "", -1
        try:
            (image, file_bytes, large_pixels), fetched = self._load(index, index, copy)
            target = self.samples[index][1]
            large_index = index if large_pixels else -1
        except BadImageError as error:
            if not self.skip_bad_images:
                raise
            self.known_bad.add(index)
            bad_index, bad_reason = index, error.reason
            image, target, file_bytes, fetched = self._next_readable(index, copy)
        return Sample(image, target, file_bytes, bad_index, bad_reason, large_index,
                      source_bytes=fetched.source_bytes, cache_bytes=fetched.cache_bytes)

    def _load(self, index: int, sample: int, copy: int = 0):
        """Sample `sample` read and through the pipeline, with the random draws
        of copy `copy` of image `index`: (pipelines.Loaded, storage.Fetched)."""
        if self.augmentation_seed is not None:
            # torchvision's random transforms draw from torch's global generator (and user transforms
            # often from Python's): both are reseeded per image. With -j 0 this is the training
            # process's generator, which the training loop reseeds before each step.
            parts = (index, copy) if copy else (index,)  # a first copy draws as an image of a plain epoch
            seed = derived_seed(self.augmentation_seed, self.epoch, *parts)
            torch.default_generator.manual_seed(seed)  # the CPU generator only: no per-image cost on GPUs
            random.seed(seed)
        pipeline = self.pipeline if self.pipeline_of_epoch is None else self.pipeline_of_epoch(self.epoch)
        self.reading.started(sample)
        try:
            fetched = self.reader.read(sample)
            return pipeline.from_bytes(fetched.data, self.samples[sample][0]), fetched
        finally:
            self.reading.finished()

    def _next_readable(self, index: int, copy: int = 0):
        # Files found unreadable by this process (or worker) are not tried again: a folder of k of
        # them would otherwise cost k^2 attempts an epoch. Which image stands in stays the same.
        for offset in range(1, len(self.samples)):
            candidate = (index + offset) % len(self.samples)
            if candidate in self.known_bad:
                continue
            try:
                (image, file_bytes, _), fetched = self._load(index, candidate, copy)  # the unreadable one's draws
            except BadImageError:
                self.known_bad.add(candidate)
                continue
            return image, self.samples[candidate][1], file_bytes, fetched
        raise BadImageError(f"{self.samples[index][0]}: no image of its split can be decoded "
                            f"(--bad-images skip has nothing to use instead)")


class EpochPipelines:
    """--progressive-resizing: the training pipeline of each epoch, at that
    epoch's crop size (config.CropSizes.train, a function of the epoch
    alone), made once per size by `make(size)`. The dataset asks it with the
    epoch Loaders.set_epoch gives it, which data-loading workers (not
    persistent: made again for each epoch's pass) get with their copy of the
    dataset: the size reaches them as the epoch of the crops' seeds does."""

    def __init__(self, make: Callable[[int], Callable], crop_sizes: CropSizes):
        self.make = make
        self.crop_sizes = crop_sizes
        self.made: Dict[int, Callable] = {}

    def __call__(self, epoch: int) -> Callable:
        size = self.crop_sizes.train(epoch)
        if size not in self.made:
            self.made[size] = self.make(size)
        return self.made[size]


def collate(samples: List[Sample]) -> Sample:
    """default_collate, except for the images: uint8 ones are stacked in
    channels-last memory (pipelines.stack_images: the layout they are
    made in), and the gpu backend's encoded files become one EncodedBatch
    (they differ in length: nothing to stack)."""
    images = [sample.image for sample in samples]
    if isinstance(images[0], torch.Tensor) and images[0].dtype != torch.uint8:
        return default_collate(samples)  # the pil backend's float images, as the reference stacks them
    rest = default_collate([sample._replace(image=0) for sample in samples])
    stacked = stack_images(images) if isinstance(images[0], torch.Tensor) else EncodedBatch(images)
    return rest._replace(image=stacked)


class BadImages:
    """The unreadable images one process met in one split (--bad-images
    skip), from the batches' markers: counted per batch on the host (the
    markers are CPU tensors, so no device sync), listed with their reasons.
    Likewise the images above Pillow's decompression-bomb limit: counted, one named."""

    def __init__(self, dataset: Dataset):
        self.samples = getattr(dataset, "samples", None)
        self.reasons: Dict[str, str] = {}
        self.large_example: Optional[str] = None  # the first image above the limit this process met

    def count_large(self, batch: Sample) -> int:
        """How many images of `batch` are above Pillow's decompression-bomb limit."""
        if self.samples is None or int(batch.large_index.max()) < 0:
            return 0
        marked = [index for index in batch.large_index.tolist() if index >= 0]
        self.large_example = self.large_example or self.samples[marked[0]][0]
        return len(marked)

    def large_note(self, ctx: Context, count: int, where: str) -> Optional[str]:
        """The line that counts the images above the limit and names one, on
        the primary (None elsewhere). `count`: those met by all processes
        (summed, so the same on each): only when there are some is this a
        collective, on all of them alike, as gathered. `where`: "train epoch 0"."""
        if not count:
            return None
        examples = [path for path in gather_to_primary(self.large_example, ctx) if path]
        if not ctx.is_primary:
            return None
        example = f", e.g. {examples[0]}" if examples else ""  # none after a resume past them all
        return (f"note: {count} image(s) of {where} above Pillow's decompression-bomb limit of "
                f"{Image.MAX_IMAGE_PIXELS:,} pixels (PIL.Image.MAX_IMAGE_PIXELS){example}: decoded anyway, each "
                f"slowly and with much memory; said once")

    def count(self, batch: Sample) -> int:
        """How many samples of `batch` stand in for unreadable files (noting which)."""
        if self.samples is None or int(batch.bad_index.max()) < 0:
            return 0
        marked = [(index, reason) for index, reason in zip(batch.bad_index.tolist(), batch.bad_reason) if index >= 0]
        for index, reason in marked:
            self.reasons[self.samples[index][0]] = reason
        return len(marked)

    def gathered(self, ctx: Context, count: int) -> Dict[str, str]:
        """Every process's list, on the primary ({} elsewhere). `count`: the
        unreadable files met by all processes (summed, so the same on each):
        only when there are some is this a collective, on all of them alike."""
        merged: Dict[str, str] = {}
        if not count:
            return merged
        for reasons in gather_to_primary(self.reasons, ctx):
            merged.update(reasons)
        return dict(sorted(merged.items()))


class SyntheticImages(Dataset):
    """Random uint8 images with labels, for benchmarks: a small pool
    generated once from `seed` and repeated, so fetching a sample costs a
    copy, not a random draw or a disk read; the device normalises them as it
    does decoded files (common.device_input.DeviceInput)."""

    POOL_SIZE = 64

    def __init__(self, length: int, image_size: int, num_classes: int, seed: int,
                 size_of_epoch: Optional[Callable[[int], int]] = None, size_flag: str = "--image-size"):
        self.length = length
        self.num_classes = num_classes
        # --progressive-resizing: epoch E's images are the top-left size_of_epoch(E) pixels of the pool's
        # (made at the largest size, `image_size`).
        self.size_of_epoch = size_of_epoch
        self.epoch = 0  # set by Loaders.set_epoch
        pool = min(self.POOL_SIZE, length)  # more images than a batch: sized here, not by the command line's check
        check_fits_in_memory(size_flag, pool * 3 * image_size ** 2,
                             f"--synthetic's {pool} distinct {image_size}x{image_size} images", memory_bytes())
        generator = torch.Generator().manual_seed(seed)
        # Interleaved pixels (channels-last), as decoded images are: see pipelines.stack_images.
        self.pool = torch.randint(0, 256, (min(self.POOL_SIZE, length), image_size, image_size, 3),
                                  generator=generator, dtype=torch.uint8).permute(0, 3, 1, 2)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key) -> Sample:
        index, _ = image_and_copy(key)
        side = self.pool.shape[-1] if self.size_of_epoch is None else self.size_of_epoch(self.epoch)
        # Copied as height x width x 3, so the image keeps the pool's interleaved layout at any side.
        image = self.pool[index % len(self.pool), :, :side, :side].permute(1, 2, 0).clone().permute(2, 0, 1)
        return Sample(image, index % self.num_classes, 0, -1, "")


class _Loader(DataLoader):
    """A DataLoader that leaves the count of its workers against the cores
    to the run: torch warns in two lines per loader, process and epoch when
    one loader's workers outnumber them; the primary says it once for the
    node instead, counting every process's (launcher.oversubscription)."""

    def check_worker_number_rationality(self) -> None:
        pass


class ShardSampler(Sampler):
    """Indices rank, rank + world_size, ...: each index on exactly one process,
    none padded or repeated, so validation counts every image exactly once
    whatever the world size (DistributedSampler pads with duplicates)."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)
        self.largest_shard = len(range(0, length, world_size))  # rank 0's: no shard holds more

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TrainSampler(Sampler):
    """This process's share of an epoch: the epoch's permutation of the
    training set (a function of seed and epoch), cut into global batches of
    batch_size x accum_steps x world_size consecutive positions; rank r takes
    positions r, r + world_size, ... of each, as accum_steps micro-batches of
    batch_size (so -b 8 --accum-steps 2 gives each rank the images -b 16
    gives it, in one optimizer step). A world of any size so covers the same
    prefix of the permutation after the same number of images, which is what
    lets a checkpoint written by W processes continue with W' (only the
    incomplete last global batch of an epoch is left out, on every process alike).

    set_epoch(epoch, images_done) starts the epoch after its first
    `images_done` positions (a mid-epoch resume), and `limit` caps its steps
    (--steps-per-epoch). A subclass changes only what the order holds (keys)."""

    def __init__(self, length: int, rank: int, world_size: int, batch_size: int, seed: int, accum_steps: int = 1):
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size  # per process and micro-batch
        self.accum_steps = accum_steps  # micro-batches per step
        self.seed = seed
        self.epoch = 0
        self.images_done = 0
        self.steps = self.steps_per_epoch()

    @property
    def global_batch(self) -> int:
        """Images of one optimizer step, all processes and micro-batches."""
        return self.batch_size * self.accum_steps * self.world_size

    def steps_per_epoch(self, limit: int = 0) -> int:
        full = self.length // self.global_batch
        return min(limit, full) if limit else full

    def set_epoch(self, epoch: int, images_done: int = 0, limit: int = 0) -> range:
        """Prepare epoch `epoch`, skipping its first `images_done` images;
        returns the step numbers it will run (the last is always
        steps_per_epoch - 1; the first is later after a resume)."""
        self.epoch = epoch
        self.images_done = images_done
        total = self.steps_per_epoch(limit)
        remaining = max(0, (total * self.global_batch - images_done) // self.global_batch)
        self.steps = remaining
        return range(total - remaining, total)

    def permutation(self) -> torch.Tensor:
        """The epoch's permutation of the training set: a function of (seed, epoch)."""
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def keys(self, positions: range) -> list:
        """The dataset keys at `positions` of the epoch's order."""
        return self.permutation()[positions.start:positions.stop:positions.step].tolist()

    def __iter__(self):
        start = self.images_done + self.rank
        stop = self.images_done + self.steps * self.global_batch
        return iter(self.keys(range(start, stop, self.world_size)))

    def __len__(self) -> int:
        return self.steps * self.batch_size * self.accum_steps


class RepeatedAugmentationSampler(TrainSampler):
    """--ra-sampler: repeated augmentation (Hoffer et al. 2020; DeiT's and
    torchvision's references' RASampler). The epoch's order is its permutation
    with each image repeated `repetitions` (K) times in a row, keys (index,
    copy), of which the epoch trains on the first `length` positions: the
    first length/K images of the permutation, K times each. Cut into global
    batches as TrainSampler cuts its order, position p goes to rank p mod
    world_size: the K copies of an image go to K different ranks where there
    are K or more, and each copy draws its own crop and flip (see
    ImageFolderDataset). A function of (seed, epoch), the same prefix whatever
    the world size: a mid-epoch resume continues it at any world size.
    torchvision's pads the repeated order to a multiple of the world size and
    keeps floor(length / 256) x 256 / world_size positions per rank; this one
    keeps whole global batches of the first `length`."""

    def __init__(self, length: int, rank: int, world_size: int, batch_size: int, seed: int, accum_steps: int = 1,
                 repetitions: int = 3):
        super().__init__(length, rank, world_size, batch_size, seed, accum_steps)
        self.repetitions = repetitions

    def keys(self, positions: range) -> list:
        # Position arithmetic, not a repeated copy of the permutation: memory stays the set's, whatever K.
        positions = positions.start + positions.step * torch.arange(len(positions))
        images = self.permutation()[positions // self.repetitions]
        return list(zip(images.tolist(), (positions % self.repetitions).tolist()))


@dataclasses.dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    classes: List[str]
    seed: int
    rank: int = 0
    backend: str = "torchvision"  # --data-backend
    jpeg_decoder: Optional[JpegDecoder] = None  # None: synthetic data
    dali: Optional[DaliDecoder] = None  # --data-backend dali: decodes the JPEGs on the device (DeviceInput)
    data_timeout: float = 0.0  # --data-timeout: seconds a batch may take; 0: for ever
    notes: List[str] = dataclasses.field(default_factory=list)  # said once before training (session.run)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int, images_done: int = 0, limit: int = 0) -> range:
        """Call before each epoch: its order and its crops depend only on
        (seed, epoch) (see TrainSampler and ImageFolderDataset); a resumed
        epoch skips the `images_done` images already trained on. Returns the
        step numbers to run (see TrainSampler.set_epoch)."""
        if isinstance(self.train.dataset, (ImageFolderDataset, SyntheticImages)):
            self.train.dataset.epoch = epoch  # the crops' seeds and, with --progressive-resizing, their size
        self.train.generator.manual_seed(derived_seed(self.seed, epoch, self.rank))  # worker seeds: unused by ours
        return self.train.sampler.set_epoch(epoch, images_done, limit)

    def batches(self, split: str) -> Iterator:
        """The batches of `split` (train or val), each within --data-timeout (data_timeout.batches)."""
        loader = self.train if split == "train" else self.val
        return batches(loader, self.data_timeout, "training" if split == "train" else "validation", self.rank)

    def train_steps(self, limit: int = 0) -> int:
        """Training steps per epoch, at most `limit` when it is set."""
        return self.train.sampler.steps_per_epoch(limit)

    @property
    def global_batch(self) -> int:
        return self.train.sampler.global_batch

    def primary_val_steps(self) -> int:
        """Validation steps of the primary, whose shard is the largest
        (ShardSampler): its count decides every process's warm-up."""
        return math.ceil(self.val.sampler.largest_shard / self.val.batch_size)

    def summary(self) -> str:
        synthetic = isinstance(self.train.dataset, SyntheticImages)
        kind = "synthetic" if synthetic else f"images (decoded by {self.backend})"
        return (f"data: {len(self.train.dataset)} training and {len(self.val.dataset)} validation {kind} "
                f"in {self.num_classes} classes")


def build_datasets(cfg: Config, ctx: Context,
                   decoder: Optional[JpegDecoder] = None) -> Tuple[Dataset, Dataset, List[str], List[str]]:
    """Training and validation sets, the class names, and what to tell the
    user about the data before training (Loaders.notes). `decoder`: see jpeg_decoder."""
    sizes = cfg.crop_sizes
    if cfg.synthetic:
        classes = [f"class{index:04d}" for index in range(SYNTHETIC_CLASSES)]
        progressive = cfg.progressive_resizing is not None
        train = SyntheticImages(IMAGENET_TRAIN_IMAGES, sizes.train_range[1], SYNTHETIC_CLASSES, cfg.seed,
                                size_of_epoch=sizes.train if progressive else None,
                                size_flag="--progressive-resizing" if progressive else "--image-size")
        val_length = SYNTHETIC_VAL_BATCHES * cfg.batch_size * ctx.replicas
        val = SyntheticImages(val_length, sizes.val, SYNTHETIC_CLASSES, cfg.seed + 1,
                              size_flag="--val-crop-size" if cfg.val_crop_size else "--image-size")
        # A habit of copied command lines; silence would suggest DATA was trained on.
        notes = [f"note: --synthetic: DATA {cfg.data} is not read; random images stand in for it"] if cfg.data else []
        if cfg.auto_augment or cfg.random_erase:  # a recipe's flags on a benchmark: said, not refused
            notes.append("note: --synthetic: its random images are not augmented (--auto-augment, --random-erase); "
                         "--mixup-alpha and --cutmix-alpha still mix its batches")
        return train, val, classes, notes
    if is_sharded(cfg.data):
        # The primary reads the manifest and indexes, once per job, and broadcasts them (see open_sharded).
        found = open_sharded(cfg.data, cfg.data_cache, cfg.data_cache_bytes, cfg.s3_endpoint_url, ctx)
        notes = [found.describe()]
    else:
        found = find_lists(cfg.data, cfg.file_list, ctx)
        notes = found.notes
    skip = cfg.bad_images == "skip"
    by_epoch = (EpochPipelines(functools.partial(pipeline, cfg, True, decoder), sizes)
                if cfg.progressive_resizing is not None else None)
    train = ImageFolderDataset(found.train, pipeline(cfg, train=True, decoder=decoder), augmentation_seed=cfg.seed,
                               skip_bad_images=skip, workers=cfg.workers, pipeline_of_epoch=by_epoch)
    val = ImageFolderDataset(found.val, pipeline(cfg, train=False, decoder=decoder), skip_bad_images=skip,
                             workers=cfg.workers)
    return train, val, found.classes, notes


def pipeline(cfg: Config, train: bool, decoder: Optional[JpegDecoder] = None,
             image_size: Optional[int] = None) -> Callable:
    """Path -> pipelines.Loaded (image, bytes read, ...), as --data-backend
    says (see common.pipelines); `decoder`: the run's (jpeg_decoder). Its
    crop: `image_size`, else --image-size in training and the validation
    crop (--val-crop-size) in validation."""
    size = image_size or (cfg.image_size if train else cfg.crop_sizes.val)
    augmentation = ImageAugmentation.of(cfg.auto_augment, cfg.ra_magnitude, cfg.augmix_severity,
                                        cfg.random_erase) if train else None
    if cfg.data_backend == "pil":
        return PILImages(train_transform(size, cfg.crop_scale, cfg.hflip, augmentation) if train else
                         val_transform(size, cfg.val_resize))
    kind = {"gpu": EncodedImages, "dali": DaliImages}.get(cfg.data_backend, TensorImages)
    return kind(train, size, cfg.crop_scale, cfg.hflip, cfg.val_resize, decoder=decoder, augmentation=augmentation)


def jpeg_decoder(data_backend: str, synthetic: bool) -> Optional[JpegDecoder]:
    """Which library decodes the run's JPEGs, chosen once for both splits
    and all data-loading workers (jpeg_decoders.choose_jpeg_decoder); Pillow's
    for --data-backend pil, None for synthetic data."""
    if synthetic:
        return None
    if data_backend == "pil":
        return JpegDecoder("pillow", PIL.__version__)  # the reference: Pillow all the way
    return choose_jpeg_decoder()


def build_loaders(cfg: Config, ctx: Context) -> Loaders:
    """Training and validation loaders of this process's share of the data.
    A process's batch is -b per replica it drives (its GPUs, under nn.DataParallel)."""
    batch_size = cfg.batch_size * ctx.replicas_per_process
    if cfg.data_backend == "gpu" and ctx.device.type != "cuda" and not cfg.synthetic:
        raise UsageError(f"argument --data-backend: gpu decodes JPEGs on a CUDA GPU; this run is on the "
                         f"{ctx.device.type.upper()} (use torchvision)")
    # DALI first: a missing package is said before the data is scanned. It drives this process's device.
    dali = (DaliDecoder(ctx.device, batch_size, cfg.workers)
            if cfg.data_backend == "dali" and not cfg.synthetic else None)
    decoder = jpeg_decoder(cfg.data_backend, cfg.synthetic)
    train_set, val_set, classes, notes = build_datasets(cfg, ctx, decoder)
    sampler = (functools.partial(RepeatedAugmentationSampler, repetitions=cfg.ra_reps) if cfg.ra_sampler
               else TrainSampler)  # --ra-sampler
    train_sampler = sampler(len(train_set), ctx.rank, ctx.world_size, batch_size, cfg.seed, cfg.accum_steps)
    if train_sampler.steps_per_epoch() == 0:
        processes = f" x {ctx.world_size} processes" if ctx.world_size > 1 else ""
        flag, micro = ("--accum-steps", f" x --accum-steps {cfg.accum_steps}") if cfg.accum_steps > 1 else \
            ("-b/--batch-size", "")
        raise UsageError(f"argument {flag}: {batch_size} per process{micro}{processes} is more than the "
                         f"{len(train_set)} training images; lower it")
    pin_memory = ctx.device.type == "cuda"
    # Workers die with their training process, even if it is killed with SIGKILL.
    worker_init_fn = data_loader_worker_init if cfg.workers else None
    # ... and leave stop signals from other processes to it, whatever threads libraries start in them;
    # DALI's threads end before each fork (a lock one of them holds would stay held in the child).
    worker_context = data_loader_context(dali.end_threads if dali is not None else None) if cfg.workers else None
    # A batch that does not come within --data-timeout raises (Loaders.batches names the worker and its file);
    # without workers the training process reads, and a thread watches it (common.data_timeout).
    timeout = cfg.data_timeout if cfg.workers else 0
    train = _Loader(
        train_set, batch_size=batch_size, sampler=train_sampler, num_workers=cfg.workers,
        pin_memory=pin_memory, worker_init_fn=worker_init_fn, multiprocessing_context=worker_context,
        collate_fn=collate, timeout=timeout,
        # The sampler yields whole batches only: a partial one would skew BatchNorm statistics.
        drop_last=True,
        generator=torch.Generator(),  # reseeded per epoch by Loaders.set_epoch
    )
    val = _Loader(
        val_set, batch_size=batch_size, sampler=ShardSampler(len(val_set), ctx.rank, ctx.world_size),
        num_workers=cfg.workers, pin_memory=pin_memory, worker_init_fn=worker_init_fn,
        multiprocessing_context=worker_context, collate_fn=collate, timeout=timeout,
    )
    # Said once by the primary, for the whole node (session.run), instead of torch's lines (_Loader).
    notes = [*notes, *filter(None, [oversubscription(ctx.procs_per_node, cfg.workers)])]
    return Loaders(train=train, val=val, classes=classes, seed=cfg.seed, rank=ctx.rank, backend=cfg.data_backend,
                   notes=notes, jpeg_decoder=decoder, dali=dali, data_timeout=cfg.data_timeout)

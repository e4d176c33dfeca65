"""Input pipelines: ImageFolder trees and synthetic tensors, samplers and loaders.

Layout read: DATA/train/<class>/<image> and DATA/val/<class>/<image>, as
torchvision's ImageFolder; class indices come from train/ and val/ uses the
same mapping. Unreadable images stop the run at once, naming the file (a
multi-hour run must neither crash later with an anonymous worker traceback
nor hang).

Reproducibility, which makes a resumed run equal an uninterrupted one: an
epoch's order is one permutation of the training set, a function of (seed,
epoch), cut into consecutive global batches whatever the world size
(TrainSampler); each image's random crop and flip are drawn from a seed of
its own, (seed, epoch, image index), so they do not depend on which process
or data-loading worker reads it, nor on how many there are. A checkpoint
taken mid-epoch records how many images of the permutation were used, and
the resumed epoch starts right after them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import random
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms

from common.cli import Config, UsageError, error_summary
from common.distributed import Context, data_loader_worker_init

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_TRAIN_IMAGES = 1_281_167  # ImageNet-1k, so --synthetic epochs have its length
SYNTHETIC_CLASSES = 1000
SYNTHETIC_VAL_BATCHES = 10  # per process: random tensors have no accuracy worth a full pass


class BadImageError(UsageError):
    """An image file that cannot be decoded; the message names the file."""

    rank_specific = True  # only the process whose share holds the file meets it

    def __init__(self, message: str):
        # A DataLoader worker's exception reaches the main process rebuilt as
        # type(error)("Caught ... Original Traceback ...\n...BadImageError: <message>");
        # keep only the original one-line message, so the user sees one line.
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class Sample(NamedTuple):
    """One training or validation sample; the DataLoader collates a batch of
    them into the same shape, with tensors. `file_bytes` is what reading the
    image took from storage (0 for synthetic data): summed over a split and
    over processes it is the exact volume the input pipeline read."""

    image: torch.Tensor
    target: int
    file_bytes: int


def read_rgb(path: str) -> Tuple[Image.Image, int]:
    """Decode any image file as 3-channel RGB (grayscale, CMYK, palette and
    RGBA images included); also returns the bytes read from the file. The
    file is read whole first (as decoding would anyway), which makes that
    count exact."""
    try:
        with open(path, "rb") as handle:
            encoded = handle.read()
        with Image.open(io.BytesIO(encoded)) as image:
            return image.convert("RGB"), len(encoded)  # convert() forces the full decode: truncation shows here
    except Exception as error:  # Pillow's decoders raise many types on bad data (OSError, SyntaxError, struct.error, ...)
        raise BadImageError(
            f"{path}: cannot decode image ({error_summary(error)}); remove or replace the file "
            f"(policy: the run stops at the first unreadable image)"
        ) from None


def _image_files(class_dir: Path) -> List[str]:
    """Image files under a class folder (recursively, following symlinks),
    by extension, case-insensitive; hidden and other files are ignored."""
    found = []
    for folder, subfolders, files in os.walk(class_dir, followlinks=True):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        found.extend(
            os.path.join(folder, name) for name in sorted(files)
            if not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)
        )
    return found


def scan_split(split_dir: Path, class_to_idx: Optional[Dict[str, int]] = None) -> Tuple[List[str], List[Tuple[str, int]]]:
    """The classes and (path, class index) samples of one split folder.

    With `class_to_idx` (train's mapping, when scanning val/) every class
    folder must be one of train's classes.
    """
    try:
        classes = sorted(entry.name for entry in os.scandir(split_dir)
                         if entry.is_dir() and not entry.name.startswith("."))
    except OSError as error:
        raise UsageError(f"{split_dir}: cannot list the folder ({error.strerror})") from None
    if not classes:
        raise UsageError(f"{split_dir}: no class folders (expected {split_dir}/<class>/<images>)")
    if class_to_idx is None:
        class_to_idx = {name: index for index, name in enumerate(classes)}
    samples = []
    for name in classes:
        if name not in class_to_idx:
            raise UsageError(f"{split_dir / name}: class {name!r} is not among the classes of train/")
        files = _image_files(split_dir / name)
        if not files:
            raise UsageError(f"{split_dir / name}: class folder has no images "
                             f"(looked for {', '.join(IMAGE_EXTENSIONS)})")
        samples.extend((path, class_to_idx[name]) for path in files)
    return classes, samples


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, epoch, index, ...): a hash, so
    neighbouring tuples get unrelated random streams."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ImageFolderDataset(Dataset):
    """(transformed image, class index) for a list of (path, class index).

    With `augmentation_seed` set (training), the transform of image `index`
    in epoch `epoch` draws its randomness from derived_seed(augmentation_seed,
    epoch, index): the same crop in whichever process or worker reads it."""

    def __init__(self, samples: Sequence[Tuple[str, int]], transform, augmentation_seed: Optional[int] = None):
        self.samples = list(samples)
        self.transform = transform
        self.augmentation_seed = augmentation_seed
        self.epoch = 0  # set by Loaders.set_epoch; data-loading workers get a copy when an epoch's iteration starts

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        path, target = self.samples[index]
        image, file_bytes = read_rgb(path)
        if self.augmentation_seed is not None:
            # torchvision's random transforms draw from torch's global generator (and user transforms
            # often from Python's): both are reseeded per image. With -j 0 this is the training
            # process's generator, which the training loop reseeds before each step.
            seed = derived_seed(self.augmentation_seed, self.epoch, index)
            torch.default_generator.manual_seed(seed)  # the CPU generator only: no per-image cost on GPUs
            random.seed(seed)
        return Sample(self.transform(image), target, file_bytes)


class SyntheticImages(Dataset):
    """Random normalised image tensors with labels, for benchmarks: a small
    pool generated once from `seed` and repeated, so fetching a sample costs a
    copy, not a random draw or a disk read."""

    POOL_SIZE = 64

    def __init__(self, length: int, image_size: int, num_classes: int, seed: int):
        self.length = length
        self.num_classes = num_classes
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(min(self.POOL_SIZE, length), 3, image_size, image_size, generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Sample:
        return Sample(self.pool[index % len(self.pool)].clone(), index % self.num_classes, 0)


class ShardSampler(Sampler):
    """Indices rank, rank + world_size, ...: each index on exactly one process,
    none padded or repeated, so validation counts every image exactly once
    whatever the world size (DistributedSampler pads with duplicates)."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TrainSampler(Sampler):
    """This process's share of an epoch: the epoch's permutation of the
    training set (a function of seed and epoch), cut into global batches of
    batch_size x world_size consecutive positions; rank r takes positions r,
    r + world_size, ... of each. A world of any size so covers the same
    prefix of the permutation after the same number of images, which is what
    lets a checkpoint written by W processes continue with W' (only the
    incomplete last global batch of an epoch is left out, on every process alike).

    set_epoch(epoch, images_done) starts the epoch after its first
    `images_done` positions (a mid-epoch resume), and `limit` caps its steps
    (--steps-per-epoch)."""

    def __init__(self, length: int, rank: int, world_size: int, batch_size: int, seed: int):
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size  # per process
        self.seed = seed
        self.epoch = 0
        self.images_done = 0
        self.steps = self.steps_per_epoch()

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

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

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=generator)
        start = self.images_done + self.rank
        stop = self.images_done + self.steps * self.global_batch
        return iter(order[start:stop:self.world_size].tolist())

    def __len__(self) -> int:
        return self.steps * self.batch_size


def train_transform(image_size: int, crop_scale: Tuple[float, float] = (0.08, 1.0), hflip: float = 0.5):
    return transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=crop_scale),
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


@dataclasses.dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    classes: List[str]
    seed: int
    rank: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int, images_done: int = 0, limit: int = 0) -> range:
        """Call before each epoch: its order and its crops depend only on
        (seed, epoch) (see TrainSampler and ImageFolderDataset); a resumed
        epoch skips the `images_done` images already trained on. Returns the
        step numbers to run (see TrainSampler.set_epoch)."""
        if isinstance(self.train.dataset, ImageFolderDataset):
            self.train.dataset.epoch = epoch
        self.train.generator.manual_seed(derived_seed(self.seed, epoch, self.rank))  # worker seeds: unused by ours
        return self.train.sampler.set_epoch(epoch, images_done, limit)

    def train_steps(self, limit: int = 0) -> int:
        """Training steps per epoch, at most `limit` when it is set."""
        return self.train.sampler.steps_per_epoch(limit)

    @property
    def global_batch(self) -> int:
        return self.train.sampler.global_batch

    def summary(self) -> str:
        kind = "synthetic" if isinstance(self.train.dataset, SyntheticImages) else "images"
        return (f"data: {len(self.train.dataset)} training and {len(self.val.dataset)} validation {kind} "
                f"in {self.num_classes} classes")


def build_datasets(cfg: Config, replicas: int) -> Tuple[Dataset, Dataset, List[str]]:
    if cfg.synthetic:
        classes = [f"class{index:04d}" for index in range(SYNTHETIC_CLASSES)]
        train = SyntheticImages(IMAGENET_TRAIN_IMAGES, cfg.image_size, SYNTHETIC_CLASSES, cfg.seed)
        val_length = SYNTHETIC_VAL_BATCHES * cfg.batch_size * replicas
        val = SyntheticImages(val_length, cfg.image_size, SYNTHETIC_CLASSES, cfg.seed + 1)
        return train, val, classes
    root = Path(cfg.data)
    classes, train_samples = scan_split(root / "train")
    _, val_samples = scan_split(root / "val", {name: index for index, name in enumerate(classes)})
    train = ImageFolderDataset(train_samples, train_transform(cfg.image_size, cfg.crop_scale, cfg.hflip),
                               augmentation_seed=cfg.seed)
    val = ImageFolderDataset(val_samples, val_transform(cfg.image_size, cfg.val_resize))
    return train, val, classes


def build_loaders(cfg: Config, ctx: Context) -> Loaders:
    """Training and validation loaders of this process's share of the data.
    A process's batch is -b per replica it drives (its GPUs, under nn.DataParallel)."""
    batch_size = cfg.batch_size * ctx.replicas_per_process
    train_set, val_set, classes = build_datasets(cfg, ctx.replicas)
    train_sampler = TrainSampler(len(train_set), ctx.rank, ctx.world_size, batch_size, cfg.seed)
    if train_sampler.steps_per_epoch() == 0:
        processes = f" x {ctx.world_size} processes" if ctx.world_size > 1 else ""
        raise UsageError(f"argument -b/--batch-size: {batch_size} per process{processes} is more than the "
                         f"{len(train_set)} training images; lower it")
    pin_memory = ctx.device.type == "cuda"
    # Workers die with their training process, even if it is killed with SIGKILL.
    worker_init_fn = data_loader_worker_init if cfg.workers else None
    train = DataLoader(
        train_set, batch_size=batch_size, sampler=train_sampler, num_workers=cfg.workers,
        pin_memory=pin_memory, worker_init_fn=worker_init_fn,
        # The sampler yields whole batches only: a partial one would skew BatchNorm statistics.
        drop_last=True,
        generator=torch.Generator(),  # reseeded per epoch by Loaders.set_epoch
    )
    val = DataLoader(
        val_set, batch_size=batch_size, sampler=ShardSampler(len(val_set), ctx.rank, ctx.world_size),
        num_workers=cfg.workers, pin_memory=pin_memory, worker_init_fn=worker_init_fn,
    )
    return Loaders(train=train, val=val, classes=classes, seed=cfg.seed, rank=ctx.rank)

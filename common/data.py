"""Input pipelines: ImageFolder trees and synthetic tensors, samplers and loaders.

Layout read: DATA/train/<class>/<image> and DATA/val/<class>/<image>, as
torchvision's ImageFolder; class indices come from train/ and val/ uses the
same mapping. Unreadable images stop the run at once, naming the file (a
multi-hour run must neither crash later with an anonymous worker traceback
nor hang).

Reproducibility: the training order is a function of (seed, epoch), via
DistributedSampler even in one process, and each epoch reseeds the worker
seeds' generator and the process's torch RNG with (seed, epoch, rank), so
augmentation depends only on (seed, epoch, rank, worker count), not on how
many epochs this process has already run. That is what makes a resumed run
equal an uninterrupted one, at any world size.
"""
from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import transforms

from common.cli import Config, UsageError, error_summary
from common.distributed import PER_RANK_SEED_STRIDE, Context, data_loader_worker_init

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


class ImageFolderDataset(Dataset):
    """(transformed image, class index) for a list of (path, class index)."""

    def __init__(self, samples: Sequence[Tuple[str, int]], transform):
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        path, target = self.samples[index]
        image, file_bytes = read_rgb(path)
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
    rank: int = 0  # this process's rank: its augmentation stream is its own

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: the epoch's shuffle (the same on every
        process) and everything random in it (crops in data-loading workers,
        or with -j 0 in this process; dropout) depend only on (seed, epoch,
        rank). A resumed run, whose processes' RNG states the checkpoint does
        not hold, so continues exactly as an uninterrupted one."""
        self.train.sampler.set_epoch(epoch)
        epoch_seed = self.seed * 100_003 + epoch + self.rank * PER_RANK_SEED_STRIDE
        self.train.generator.manual_seed(epoch_seed)
        torch.manual_seed(epoch_seed)

    def train_steps(self, limit: int = 0) -> int:
        """Training steps per epoch, at most `limit` when it is set."""
        return min(limit, len(self.train)) if limit else len(self.train)

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
    train = ImageFolderDataset(train_samples, train_transform(cfg.image_size, cfg.crop_scale, cfg.hflip))
    val = ImageFolderDataset(val_samples, val_transform(cfg.image_size, cfg.val_resize))
    return train, val, classes


def build_loaders(cfg: Config, ctx: Context) -> Loaders:
    """Training and validation loaders of this process's share of the data.
    A process's batch is -b per replica it drives (its GPUs, under nn.DataParallel)."""
    batch_size = cfg.batch_size * ctx.replicas_per_process
    train_set, val_set, classes = build_datasets(cfg, ctx.replicas)
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank,
                                       shuffle=True, seed=cfg.seed)
    if len(train_sampler) < batch_size:
        raise UsageError(f"argument -b/--batch-size: {batch_size} per process is more than the "
                         f"{len(train_sampler)} training images per process; lower it")
    pin_memory = ctx.device.type == "cuda"
    # Workers die with their training process, even if it is killed with SIGKILL.
    worker_init_fn = data_loader_worker_init if cfg.workers else None
    train = DataLoader(
        train_set, batch_size=batch_size, sampler=train_sampler, num_workers=cfg.workers,
        pin_memory=pin_memory, worker_init_fn=worker_init_fn,
        # A partial last batch would skew BatchNorm statistics (and fails outright with one image).
        drop_last=True,
        generator=torch.Generator(),  # reseeded per epoch by Loaders.set_epoch
    )
    val = DataLoader(
        val_set, batch_size=batch_size, sampler=ShardSampler(len(val_set), ctx.rank, ctx.world_size),
        num_workers=cfg.workers, pin_memory=pin_memory, worker_init_fn=worker_init_fn,
    )
    return Loaders(train=train, val=val, classes=classes, seed=cfg.seed, rank=ctx.rank)

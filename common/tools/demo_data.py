"""Datasets written to disk in the ImageNet folder layout, with no download.

    python -m common.tools.demo_data digits data/digits
        scikit-learn's bundled handwritten digits (1,797 real 8x8 images,
        10 classes), upscaled to 64x64 JPEGs and split into train/ and val/
        with a fixed seed: the default dataset of `make demo`.
    python -m common.tools.demo_data fake-imagenet data/fake --classes 10 --train-per-class 100
        ImageNet-shaped JPEGs (about 500x375 pixels and 100 KB each) of
        smooth random content: for I/O and input-pipeline tests on your own
        file system. Not learnable: labels are arbitrary.

A dataset folder is written under a temporary name and renamed when
complete, with its parameters in dataset.json; running the command again
with the same parameters reuses it, and an existing folder is never
overwritten.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np
from PIL import Image

from common.arguments import Parser, check_fits_in_memory, memory_bytes, non_negative_int, positive_int
from common.errors import UsageError, run_main
from common.files import format_bytes, room_at, temporary_sibling

DIGITS_CLASSES = [f"digit_{index}" for index in range(10)]
FAKE_IMAGE_LEAST_BYTES = 90_000  # a fake ImageNet JPEG: 94 to 114 KB measured (quality 93, about 475x354)


def _write_dataset(out: Path, parameters: dict, write: Callable[[Path], Dict[str, int]]) -> Dict[str, int]:
    """Write a dataset folder atomically (temporary folder, then rename), or
    reuse an existing one written with the same parameters."""
    out = out.absolute()  # "." has a usable .name (for the temporary sibling) only in absolute form
    marker = out / "dataset.json"
    if out.exists():
        try:
            written = json.loads(marker.read_text())
        except (OSError, ValueError):
            written = {}
        if written.get("parameters") == parameters and "counts" in written:
            return written["counts"]
        raise UsageError(f"{out}: exists and is not a dataset written with these parameters; "
                         f"choose another folder or remove it")
    temporary = temporary_sibling(out)
    try:
        counts = write(temporary)
        (temporary / "dataset.json").write_text(json.dumps({"parameters": parameters, "counts": counts}, indent=2))
        os.replace(temporary, out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)
    return counts


def write_digits(out: Path, image_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> Dict[str, int]:
    """scikit-learn's digits as out/{train,val}/digit_<d>/<index>.JPEG.

    The split is stratified: in each class a seeded shuffle sends
    round(val_fraction x class size) images to val/. Returns image counts.
    """
    from sklearn.datasets import load_digits  # ships with scikit-learn: no download

    parameters = {"kind": "digits", "image_size": image_size, "val_fraction": val_fraction, "seed": seed}

    def write(root: Path) -> Dict[str, int]:
        digits = load_digits()
        rng = np.random.default_rng(seed)
        counts = {"train": 0, "val": 0}
        for label, class_name in enumerate(DIGITS_CLASSES):
            indices = np.flatnonzero(digits.target == label)
            shuffled = rng.permutation(indices)
            val_count = int(round(val_fraction * len(indices)))
            for split, chosen in (("val", shuffled[:val_count]), ("train", shuffled[val_count:])):
                folder = root / split / class_name
                folder.mkdir(parents=True, exist_ok=True)
                for index in sorted(chosen):
                    # Pixel values are 0..16; scale to 0..255, then upscale smoothly like a real photo.
                    pixels = (digits.images[index] * (255.0 / 16.0)).round().astype(np.uint8)
                    image = Image.fromarray(pixels).resize((image_size, image_size), Image.BICUBIC)
                    image.save(folder / f"{index:04d}.JPEG", quality=95)
                    counts[split] += 1
        return counts

    return _write_dataset(Path(out), parameters, write)


def fake_imagenet_image(rng: np.random.Generator, width: int = 500, height: int = 375) -> Image.Image:
    """A colour image with ImageNet-like JPEG statistics: smooth random colour
    fields (upscaled from a coarse grid) plus fine grain, so it neither
    compresses to nothing nor to noise-sized files."""
    coarse = rng.integers(0, 256, size=(rng.integers(4, 12), rng.integers(4, 12), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float32)
    grain = rng.normal(0.0, 20.0, size=(height, width, 3)).astype(np.float32)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def _write_fake_class(folder: str, class_name: str, count: int, seed: Sequence[int], quality: int) -> int:
    """`count` fake ImageNet JPEGs of one class and split into `folder`; their bytes.
    Its own random stream (`seed`): the same files whatever the number of processes."""
    rng = np.random.default_rng(list(seed))
    Path(folder).mkdir(parents=True, exist_ok=True)
    written = 0
    for image_index in range(count):
        # ImageNet images vary in size around 500x375 (landscape, mostly).
        width, height = int(rng.integers(450, 501)), int(rng.integers(333, 376))
        buffer = io.BytesIO()
        fake_imagenet_image(rng, width, height).save(buffer, format="JPEG", quality=quality)
        Path(folder, f"{class_name}_{image_index}.JPEG").write_bytes(buffer.getvalue())
        written += buffer.tell()
    return written


def write_fake_imagenet(out: Path, classes: int = 10, train_per_class: int = 100, val_per_class: int = 10,
                        seed: int = 0, quality: int = 93, processes: Optional[int] = None) -> Dict[str, int]:
    """A tree of ImageNet-shaped JPEGs: out/{train,val}/n<8 digits>/<class>_<i>.JPEG,
    encoded by `processes` processes (default: one per CPU core, as many as there are folders)."""
    parameters = {"kind": "fake-imagenet", "classes": classes, "train_per_class": train_per_class,
                  "val_per_class": val_per_class, "seed": seed, "quality": quality}

    def write(root: Path) -> Dict[str, int]:
        _check_room(root, classes * (train_per_class + val_per_class))
        chunks = []  # (split, folder, class name, count, seed)
        for class_index in range(classes):
            class_name = f"n{class_index:08d}"  # ImageNet's WordNet ids look like n01440764
            for split_index, (split, per_class) in enumerate((("train", train_per_class), ("val", val_per_class))):
                chunks.append((split, str(root / split / class_name), class_name, per_class,
                               (seed, class_index, split_index), quality))
        workers = max(1, min(processes or os.cpu_count() or 1, len(chunks)))
        counts = {"train": 0, "val": 0, "bytes": 0}
        # ~15 ms an image on one core: ImageNet-sized trees are worth every core. A fresh interpreter
        # per worker (spawn): the caller may hold threads (torch's) that fork would copy mid-lock.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) if workers > 1 else \
                contextlib.nullcontext() as pool:
            results = (pool.map(_write_fake_class, *zip(*[chunk[1:] for chunk in chunks])) if pool else
                       (_write_fake_class(*chunk[1:]) for chunk in chunks))
            for (split, _, _, count, _, _), written in zip(chunks, results):
                counts[split] += count
                counts["bytes"] += written
        return counts

    return _write_dataset(Path(out), parameters, write)


def _check_room(root: Path, images: int) -> None:
    """Room on `root`'s file system for `images` fake ImageNet JPEGs, told
    before the first is written (and before a list of them is made)."""
    needed, free = images * FAKE_IMAGE_LEAST_BYTES, room_at(root)[0]
    if needed > free:
        raise UsageError(f"{root.parent}: {images:,} images of about 100 KB need {format_bytes(needed)} or more, "
                         f"and {format_bytes(free)} is free there; ask for fewer (--classes, --train-per-class, "
                         f"--val-per-class)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.demo_data", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    digits = commands.add_parser("digits", help="scikit-learn's handwritten digits as JPEGs")
    digits.add_argument("out", type=Path)
    digits.add_argument("--image-size", type=positive_int, default=64)
    digits.add_argument("--seed", type=non_negative_int, default=0)
    fake = commands.add_parser("fake-imagenet", help="ImageNet-shaped random JPEGs for I/O tests")
    fake.add_argument("out", type=Path)
    fake.add_argument("--classes", type=positive_int, default=10)
    fake.add_argument("--train-per-class", type=positive_int, default=100)
    fake.add_argument("--val-per-class", type=positive_int, default=10)
    fake.add_argument("--seed", type=non_negative_int, default=0)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "digits":
        check_fits_in_memory("--image-size", args.image_size ** 2, f"one {args.image_size}x{args.image_size} "
                             f"digit image", memory_bytes())
        counts = write_digits(args.out, image_size=args.image_size, seed=args.seed)
    else:
        counts = write_fake_imagenet(args.out, args.classes, args.train_per_class, args.val_per_class, args.seed)
    print(f"{args.out}: {counts['train']} training and {counts['val']} validation images", file=sys.stdout)


if __name__ == "__main__":
    run_main(main)

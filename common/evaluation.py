"""--evaluate's scores beyond DATA's validation split (docs/outputs.md):
other labelled sets in the ImageFolder layout (--eval-set NAME=DIR, e.g.
ImageNet-V2's three folders, whose class folders are named by class index),
and ImageNet-ReaL's multi-label top-1 of the validation split (--real-labels
real.json: Beyer et al. 2020, "Are we done with ImageNet?").

Every figure counts each image exactly once at any world size: each process
writes the top-1 guesses of its own images (ShardSampler's share) into a
vector as long as the set, zeros elsewhere, and the vectors are summed over
the processes before anything is counted (Predictions), as common.meters
sums its counts.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from common.config import Config
from common.data import ImageFolderDataset, Loaders, ShardSampler
from common.dataset_lists import FileList, scan_split
from common.distributed import Context, all_reduce_sum, decided_by_primary
from common.engine import Trainer
from common.errors import UsageError
from common.files import atomic_write_text, format_bytes
from common.meters import top_classes
from common.fit import Validation, validate
from common.telemetry import RunLog

# ImageNet's validation images: real.json's entry i holds the real labels of ILSVRC2012_val_{i+1:08d}.JPEG.
# A sharded split names an image "<path> (in <shard>)".
REAL_NAME = re.compile(r"(?:^|/)ILSVRC2012_val_(\d{8})\.JPEG(?:$| \(in )")
# real.json is 0.4 MB for ImageNet's 50,000 images; a file far larger is not one, and parsing it would take the
# memory (a JSON list of integers takes ~30 times its bytes as Python objects).
MAX_REAL_LABELS_BYTES = 64 << 20
EVALUATION_COLUMNS = ["set", "weights", "images", "loss", "top1", "top5", "macro_f1", "real_top1", "real_correct",
                      "real_counted", "real_left_out"]


@dataclasses.dataclass(frozen=True)
class RealScore:
    """ImageNet-ReaL's top-1: an image is right when its top-1 guess is any of its real labels; images without
    real labels (an empty list in real.json) are left out of the ratio, and counted apart."""

    correct: int  # counted images whose top-1 guess is one of their real labels
    counted: int  # images scored: those read (not skipped by --bad-images skip) with at least one real label
    left_out: int  # images read that have no real label

    @property
    def top1(self) -> float:
        """Percent; nan with no image counted."""
        return 100.0 * self.correct / self.counted if self.counted else float("nan")

    def describe(self) -> str:
        return (f"ReaL top1 {self.top1:.2f}% ({self.correct}/{self.counted} images with real labels; "
                f"{self.left_out} without, left out)")


def real_top1(predicted: np.ndarray, real_labels: Sequence[Tuple[int, ...]]) -> RealScore:
    """ReaL's top-1 of a set whose image i was guessed `predicted[i]` (-1: not read, so not scored) and has the
    real labels `real_labels[i]` (empty: none)."""
    correct = counted = left_out = 0
    for guess, labels in zip(predicted.tolist(), real_labels):
        if guess < 0:
            continue
        if not labels:
            left_out += 1
            continue
        counted += 1
        correct += guess in labels
    return RealScore(correct, counted, left_out)


class Predictions:
    """The top-1 guess of each image of a set, by dataset index, summed over
    the processes (each writes only its own images'): a validation pass's
    per-image record, for ReaL's score and predictions.csv."""

    def __init__(self, length: int, device: torch.device):
        self.guess_plus_one = torch.zeros(length, dtype=torch.int64, device=device)  # 0: not read here

    def add(self, indices: torch.Tensor, logits: torch.Tensor) -> None:
        """A batch's images (dataset indices) and their logits. The guess is the first of meters' ranking, the
        per-class report's guess, ties included."""
        guesses = top_classes(logits.detach(), 5)[:, 0]
        self.guess_plus_one[indices.to(self.guess_plus_one.device)] = guesses + 1

    def gathered(self, ctx: Context) -> np.ndarray:
        """Each image's guess, -1 for one no process read (unreadable: --bad-images skip). A collective."""
        return all_reduce_sum(self.guess_plus_one.clone(), ctx).cpu().numpy() - 1


# --- ImageNet-ReaL's labels ---

def read_real_labels(path: str) -> List[List[int]]:
    """real.json: a JSON list whose entry i lists the real labels (class indices) of ImageNet's validation
    image i + 1; each mistake one line naming the file."""
    where = f"argument --real-labels: {path}"
    try:
        size = os.path.getsize(path)
        if size > MAX_REAL_LABELS_BYTES:
            raise UsageError(f"{where}: {format_bytes(size)}, more than the {format_bytes(MAX_REAL_LABELS_BYTES)} "
                             f"a real.json can take (ImageNet's is 0.4 MB); is it the right file?")
        with open(path, "rb") as handle:
            entries = json.load(handle)
    except OSError as error:
        raise UsageError(f"{where}: cannot read it ({error.strerror})") from None
    except (ValueError, RecursionError) as error:  # JSON's errors and undecodable text are ValueErrors
        raise UsageError(f"{where}: not JSON ({str(error).splitlines()[0]})") from None
    if not isinstance(entries, list):
        raise UsageError(f"{where}: expected a JSON list of lists of class indices, got {type(entries).__name__}")
    for number, labels in enumerate(entries, start=1):
        if not isinstance(labels, list) or not all(type(label) is int and label >= 0 for label in labels):
            raise UsageError(f"{where}: entry {number} (ILSVRC2012_val_{number:08d}.JPEG) is {str(labels)[:60]}, "
                             f"not a list of class indices")
    return entries


def real_labels_of(entries: List[List[int]], samples: Sequence[Tuple[str, int]], num_classes: int,
                   path: str) -> List[Tuple[int, ...]]:
    """The real labels of each of the validation split's `samples` (path, class index), found by the file's
    name; a file not named as ImageNet's validation images, or past real.json's end, is one line."""
    where = f"argument --real-labels: {path}"
    labels = []
    for file, _ in samples:
        named = REAL_NAME.search(file)
        if named is None:
            raise UsageError(f"{where}: the validation image {file} is not named ILSVRC2012_val_<8 digits>.JPEG; "
                             f"ReaL's labels are for ImageNet's validation images, by their names")
        number = int(named.group(1))
        if not 1 <= number <= len(entries):
            raise UsageError(f"{where}: the validation image {file} is number {number}, past the file's "
                             f"{len(entries)} entries")
        real = tuple(entries[number - 1])
        if any(label >= num_classes for label in real):
            raise UsageError(f"{where}: entry {number} (ILSVRC2012_val_{number:08d}.JPEG) holds class {max(real)}, "
                             f"but the model has {num_classes} classes (0..{num_classes - 1})")
        labels.append(real)
    return labels


# --- other labelled sets ---

def eval_set_classes(folder: Path, classes: Sequence[str]) -> Dict[str, int]:
    """The training class index of each class folder of an --eval-set: by name where every folder is named as
    a training class (ImageNet's wnids), else by number where every folder is a class index (ImageNet-V2's
    0..999); a folder that is neither is one line naming it."""
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))
    except OSError as error:
        raise UsageError(f"argument --eval-set: {folder}: cannot list the folder ({error.strerror})") from None
    by_name = {name: index for index, name in enumerate(classes)}
    if all(name in by_name for name in names):
        return {name: by_name[name] for name in names}
    for name in names:
        if not (name.isdigit() and name == str(int(name)) and int(name) < len(classes)):
            raise UsageError(f"argument --eval-set: {folder / name}: the class folder {name!r} is neither a training "
                             f"class (e.g. {classes[0]!r}) nor a class index 0..{len(classes) - 1}")
    return {name: int(name) for name in names}


def scan_eval_set(folder: str, classes: Sequence[str]) -> FileList:
    """An --eval-set's (path, training class index) samples (on the primary: decided_by_primary)."""
    _, samples = scan_split(Path(folder), eval_set_classes(Path(folder), classes))
    return samples


def loaders_of_set(loaders: Loaders, samples: FileList, ctx: Context) -> Loaders:
    """`loaders` with a validation loader over `samples`, read as DATA's validation split is (its pipeline,
    batch, workers and their settings), each image on one process (ShardSampler)."""
    val, dataset = loaders.val, loaders.val.dataset
    images = ImageFolderDataset(samples, dataset.pipeline, skip_bad_images=dataset.skip_bad_images,
                                workers=val.num_workers)
    loader = type(val)(images, batch_size=val.batch_size, sampler=ShardSampler(len(images), ctx.rank, ctx.world_size),
                       num_workers=val.num_workers, pin_memory=val.pin_memory, worker_init_fn=val.worker_init_fn,
                       multiprocessing_context=val.multiprocessing_context if val.num_workers else None,
                       collate_fn=val.collate_fn, timeout=val.timeout)
    return dataclasses.replace(loaders, val=loader)


# --- the whole of --evaluate ---

@dataclasses.dataclass(frozen=True)
class Scored:
    """One set's validation (the model's, and the EMA's), and what ReaL made of each (None: not scored)."""

    name: str  # "val": DATA's validation split; else the --eval-set's NAME
    validation: Validation
    real: Tuple[Optional[RealScore], Optional[RealScore]] = (None, None)  # the model's, the EMA's

    def rows(self) -> List[dict]:
        """evaluation.csv's rows: one per weights validated."""
        rows = []
        for weights, metrics, real in (("model", self.validation.val, self.real[0]),
                                       ("ema", self.validation.ema, self.real[1])):
            if metrics is None:
                continue
            row = {"set": self.name, "weights": weights, "images": metrics.images, "loss": f"{metrics.loss:.6f}",
                   "top1": f"{metrics.top1:.4f}", "top5": f"{metrics.top5:.4f}", "macro_f1": f"{metrics.macro_f1:.4f}"}
            if real is not None:
                row.update(real_top1=f"{real.top1:.4f}", real_correct=real.correct, real_counted=real.counted,
                           real_left_out=real.left_out)
            rows.append(row)
        return rows


def evaluate(trainer: Trainer, loaders: Loaders, epoch: int, has_ema: bool, cfg: Config, ctx: Context,
             log: RunLog) -> List[Scored]:
    """--evaluate: DATA's validation split (with ReaL's top-1 under --real-labels), then each --eval-set; the
    model, and the checkpoint's --model-ema average too when it holds one. Lines on the primary; with
    --report-dir, per-class reports, evaluation.csv and predictions.csv there. The labels and the sets are
    read (and any mistake said) before the first pass."""
    val_set = loaders.val.dataset
    real = None
    if cfg.real_labels is not None:
        real = decided_by_primary(lambda: real_labels_of(read_real_labels(cfg.real_labels), val_set.samples,
                                                         loaders.num_classes, cfg.real_labels), ctx)
    sets = [(name, decided_by_primary(lambda: scan_eval_set(folder, loaders.classes), ctx))
            for name, folder in cfg.eval_sets]
    passes = [Predictions(len(val_set), ctx.device) for _ in range(2 if has_ema else 1)]
    validated = validate(trainer, loaders, epoch, averaged=has_ema, predictions=passes)
    guesses = [predictions.gathered(ctx) for predictions in passes]
    log.evaluation(validated.val, validated.report, loaders.classes, report_dir=cfg.report_dir, ema=validated.ema,
                   report_source=validated.source)
    scores = (None, None)
    if real is not None:
        scores = tuple(real_top1(guess, real) for guess in guesses) + (None,) * (2 - len(guesses))
        for score, whose in zip(scores, ("", " of the EMA")):
            if score is not None:
                log.info(f"validation{whose}: {score.describe()}")
    scored = [Scored("val", validated, scores)]
    for name, samples in sets:
        on_set = validate(trainer, loaders_of_set(loaders, samples, ctx), epoch, averaged=has_ema)
        log.evaluation(on_set.val, on_set.report, loaders.classes, report_dir=cfg.report_dir, ema=on_set.ema,
                       report_source=on_set.source, set_name=name)
        scored.append(Scored(name, on_set))
    if log.is_primary and cfg.report_dir is not None:  # --synthetic's random images have no files to list
        _write_reports(Path(cfg.report_dir), scored, getattr(val_set, "samples", ()), guesses, real)
        log.info(f"figures of every set: {Path(cfg.report_dir) / 'evaluation.csv'}; the validation split's guess "
                 f"of each image: {Path(cfg.report_dir) / 'predictions.csv'}")
    return scored


def _write_reports(folder: Path, scored: List[Scored], samples: Sequence[Tuple[str, int]], guesses: List[np.ndarray],
                   real: Optional[List[Tuple[int, ...]]]) -> None:
    """evaluation.csv (a row per set and weights) and predictions.csv (the validation split's images: path, class,
    the model's guess, the EMA's, the real labels), each written whole, never over an existing file."""
    def write_figures(handle) -> None:
        writer = csv.DictWriter(handle, EVALUATION_COLUMNS)
        writer.writeheader()
        writer.writerows(row for one in scored for row in one.rows())

    def write_guesses(handle) -> None:
        writer = csv.writer(handle)
        writer.writerow(["index", "path", "class", "predicted", *(["predicted_ema"] if len(guesses) > 1 else []),
                         *(["real_labels"] if real is not None else [])])
        for index, (path, target) in enumerate(samples):
            guessed = [str(guess[index]) if guess[index] >= 0 else "" for guess in guesses]  # "": unreadable
            labels = [" ".join(map(str, real[index]))] if real is not None else []
            writer.writerow([index, path, target, *guessed, *labels])

    atomic_write_text(folder / "evaluation.csv", write_figures, overwrite=False)
    atomic_write_text(folder / "predictions.csv", write_guesses, overwrite=False)

"""Accuracy and loss as sums and counts.

Sums stay on the device during an epoch (no host sync per step) and are
summed across processes before anything is divided, so a metric is the same
whatever the world size: never an average of per-process averages.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
import torch

from common.distributed import Context, all_reduce_sum
from common.files import format_bytes


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Number of samples whose target is among the k highest logits, for each k.

    k larger than the number of classes counts every sample (the target is
    always among all classes), so top-5 is defined on a 3-class problem too.
    Returns a float64 tensor of len(ks) counts on the logits' device.
    """
    return _hits(top_classes(logits, max(ks)), target, ks, logits.size(1))


def top_classes(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(batch, min(k, classes)) class indices, best first: one ranking serves
    top-k, the per-class report and --evaluate's per-image guesses
    (common.evaluation), so they agree on ties."""
    return logits.topk(min(k, logits.size(1)), dim=1, largest=True, sorted=True).indices


def _hits(top: torch.Tensor, target: torch.Tensor, ks: Sequence[int], num_classes: int) -> torch.Tensor:
    hits = top.eq(target.view(-1, 1))  # at most one True per row
    cumulative = hits.cumsum(dim=1).sum(dim=0, dtype=torch.float64)  # hits within the first j+1 guesses
    return torch.stack([cumulative[min(k, num_classes) - 1] for k in ks])


class MetricSums:
    """Running sums of one split: loss, top-1 and top-5 hits and sample count
    on the device; on the host, the images timed for throughput (those after
    the warm-up steps) and the bytes read from image files; optionally, for
    the per-class report, per-class counts and the confusion matrix, also on
    the device (updated with scatter_add, which needs no host sync)."""

    # Positions in the sums vector.
    LOSS, TOP1, TOP5, COUNT = range(4)
    # Rows of the per-class counts.
    TRUE_POSITIVES, PREDICTED, SUPPORT = range(3)
    # Above this many classes the confusion matrix (classes^2 counts: 32 MiB at 2048, 3.8 GB for
    # ImageNet-21k) is not kept; the per-class report needs only the per-class counts.
    CONFUSION_MAX_CLASSES = 2048

    def __init__(self, device: torch.device, num_classes: int = 0):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.timed_count = 0
        self.file_bytes = 0
        self.source_bytes = 0  # of file_bytes' reads, pulled from DATA's storage (common.storage.Fetched)
        self.cache_bytes = 0  # read from the node-local cache (--data-cache)
        self.bad_images = 0
        self.large_images = 0
        self.num_classes = num_classes
        self.class_counts = torch.zeros(3, num_classes, dtype=torch.int64, device=device) if num_classes else None
        keep_matrix = 0 < num_classes <= self.CONFUSION_MAX_CLASSES
        # Flattened [true class, predicted class] counts.
        self.confusion = torch.zeros(num_classes ** 2, dtype=torch.int64, device=device) if keep_matrix else None

    def add(self, loss_mean: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, *, file_bytes: int = 0,
            bad_images: int = 0, large_images: int = 0, timed: bool = True, source_bytes: int = 0,
            cache_bytes: int = 0) -> None:
        """Add one batch: `loss_mean` is the criterion's mean over the batch;
        `timed`: the batch counts for throughput (it is past the warm-up);
        `bad_images`: unreadable files met in it (see data.BadImages)."""
        count = target.size(0)
        logits = logits.detach()
        top = top_classes(logits, 5)
        self.sums[self.LOSS] += loss_mean.detach().double() * count
        self.sums[self.TOP1:self.COUNT] += _hits(top, target, (1, 5), logits.size(1))
        self.sums[self.COUNT] += count
        self.timed_count += count if timed else 0
        self.add_files(file_bytes, bad_images, large_images, source_bytes, cache_bytes)
        if self.class_counts is not None:
            predicted = top[:, 0]
            ones = torch.ones_like(target)
            self.class_counts[self.TRUE_POSITIVES].scatter_add_(0, target, predicted.eq(target).long())
            self.class_counts[self.PREDICTED].scatter_add_(0, predicted, ones)
            self.class_counts[self.SUPPORT].scatter_add_(0, target, ones)
            if self.confusion is not None:
                self.confusion.scatter_add_(0, target * self.num_classes + predicted, ones)

    def add_files(self, file_bytes: int = 0, bad_images: int = 0, large_images: int = 0, source_bytes: int = 0,
                  cache_bytes: int = 0) -> None:
        """Count a batch's reads, also of one that adds nothing else (a skipped step)."""
        self.file_bytes += file_bytes
        self.source_bytes += source_bytes
        self.cache_bytes += cache_bytes
        self.bad_images += bad_images
        self.large_images += large_images

    def totals(self, ctx: Optional[Context] = None) -> "MetricTotals":
        """The sums as Python numbers; with `ctx`, summed over all processes
        first (a collective: every process must call it)."""
        host = torch.tensor([self.timed_count, self.file_bytes, self.bad_images, self.large_images,
                             self.source_bytes, self.cache_bytes], dtype=torch.float64, device=self.sums.device)
        sums = torch.cat([self.sums, host])  # one reduction for all: float64 counts bytes exactly up to 2**53
        if ctx is not None:
            all_reduce_sum(sums, ctx)
        loss_sum, top1, top5, count, timed_count, file_bytes, bad_images, large_images, source, cache = sums.tolist()
        return MetricTotals(loss_sum=loss_sum, top1_correct=int(top1), top5_correct=int(top5), count=int(count),
                            timed_count=int(timed_count), file_bytes=int(file_bytes), bad_images=int(bad_images),
                            large_images=int(large_images), source_bytes=int(source), cache_bytes=int(cache))

    def class_report(self, ctx: Context) -> "ClassReport":
        """The per-class report over all processes (a collective; needs num_classes)."""
        counts = all_reduce_sum(self.class_counts.clone(), ctx).cpu().numpy()
        confusion = None
        if self.confusion is not None:
            confusion = all_reduce_sum(self.confusion.clone(), ctx).cpu().numpy()
            confusion = confusion.reshape(self.num_classes, self.num_classes)
        return ClassReport(true_positives=counts[self.TRUE_POSITIVES], predicted=counts[self.PREDICTED],
                           support=counts[self.SUPPORT], confusion=confusion)


@dataclasses.dataclass(frozen=True)
class MetricTotals:
    loss_sum: float
    top1_correct: int
    top5_correct: int
    count: int
    timed_count: int = 0  # images after the warm-up steps
    file_bytes: int = 0  # read from image files
    bad_images: int = 0  # samples standing in for unreadable image files (--bad-images skip)
    large_images: int = 0  # images above Pillow's decompression-bomb limit (data.BadImages.count_large)
    source_bytes: int = 0  # pulled from DATA's storage: image files, shard ranges, whole shards copied to the cache
    cache_bytes: int = 0  # read from the node-local cache (--data-cache)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    def plus(self, other: "MetricTotals") -> "MetricTotals":
        """Two parts of one split (before and after a resume) as one."""
        return MetricTotals(**{field.name: getattr(self, field.name) + getattr(other, field.name)
                               for field in dataclasses.fields(self)})

    @property
    def top1(self) -> float:
        """Percent."""
        return 100.0 * self.top1_correct / self.count if self.count else float("nan")

    @property
    def top5(self) -> float:
        """Percent."""
        return 100.0 * self.top5_correct / self.count if self.count else float("nan")


@dataclasses.dataclass(frozen=True)
class ClassReport:
    """Per-class precision, recall, F1 and support, in percent, from per-class
    counts (and the confusion matrix, rows: true class, columns: predicted
    class, when there are few enough classes to keep it). The predicted class
    is top-1's guess. A class never predicted has precision 0; macro averages are over the classes that have validation
    images; micro averages pool every image, so for one label per image micro
    precision = recall = F1 = top-1."""

    true_positives: np.ndarray
    predicted: np.ndarray
    support: np.ndarray
    confusion: Optional[np.ndarray] = None

    @staticmethod
    def from_confusion(confusion: np.ndarray) -> "ClassReport":
        return ClassReport(true_positives=np.diag(confusion), predicted=confusion.sum(axis=0),
                           support=confusion.sum(axis=1), confusion=confusion)

    @staticmethod
    def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
        return np.divide(100.0 * numerator, denominator, out=np.zeros(len(numerator)), where=denominator > 0)

    @property
    def precision(self) -> np.ndarray:
        return self._ratio(self.true_positives, self.predicted)

    @property
    def recall(self) -> np.ndarray:
        return self._ratio(self.true_positives, self.support)

    @property
    def f1(self) -> np.ndarray:
        precision, recall = self.precision, self.recall
        return self._ratio(2 * precision * recall / 100.0, precision + recall)

    def macro(self, values: np.ndarray) -> float:
        present = self.support > 0
        return float(values[present].mean()) if present.any() else float("nan")

    @property
    def macro_f1(self) -> float:
        return self.macro(self.f1)

    @property
    def micro(self) -> float:
        total = self.support.sum()
        return 100.0 * float(self.true_positives.sum()) / total if total else float("nan")


@dataclasses.dataclass(frozen=True)
class SplitTiming:
    """Where one split's wall time went (see telemetry.StepTimer)."""

    steps: int
    warmup_steps: int  # the first steps, left out of the rates below
    seconds: float  # wall time of the whole split (checkpoint writing left out)
    timed_seconds: float  # wall time of the steps after the warm-up
    data_wait_seconds: float  # waiting for the next batch after the warm-up, all processes summed
    all_timed_seconds: float  # timed_seconds of all processes summed
    peak_memory_mib: Optional[float] = None
    host_memory_mib: Optional[float] = None  # resident memory of the training process at the end, max over processes

    @property
    def data_wait_fraction(self) -> float:
        """Share of the timed wall time spent waiting for the next batch, all processes."""
        return self.data_wait_seconds / self.all_timed_seconds if self.all_timed_seconds > 0 else math.nan

    def plus(self, other: "SplitTiming") -> "SplitTiming":
        """Two parts of one split (before and after a resume) as one."""
        peaks = [peak for peak in (self.peak_memory_mib, other.peak_memory_mib) if peak is not None]
        return SplitTiming(steps=self.steps + other.steps, warmup_steps=self.warmup_steps + other.warmup_steps,
                           seconds=self.seconds + other.seconds, timed_seconds=self.timed_seconds + other.timed_seconds,
                           data_wait_seconds=self.data_wait_seconds + other.data_wait_seconds,
                           all_timed_seconds=self.all_timed_seconds + other.all_timed_seconds,
                           peak_memory_mib=max(peaks) if peaks else None,
                           host_memory_mib=other.host_memory_mib if other.host_memory_mib is not None
                           else self.host_memory_mib)


@dataclasses.dataclass(frozen=True)
class EpochMetrics:
    """One row of metrics.csv: one split of one epoch, over all processes.
    Rates (images/s, s/step, data wait) leave out the split's warm-up steps."""

    epoch: int  # 0-based, as in progress lines and --start-epoch
    split: str  # "train" or "val"
    loss: float
    top1: float  # percent
    top5: float  # percent
    images: int  # images processed by all processes together
    steps: int  # steps (batches) per process
    seconds: float  # wall time of the split, every step
    images_per_second: float  # global, after the warm-up steps
    seconds_per_step: float  # after the warm-up steps
    data_wait_fraction: float  # share of the wall time after warm-up spent waiting for the next batch, all processes
    lr: Optional[float]  # learning rate of the epoch's last step (train only)
    wall_time: float  # UNIX seconds at the end of the split
    loss_scale: Optional[float] = None  # fp16 loss scale at the end of the split (mixed precision only)
    skipped_steps: Optional[int] = None  # steps skipped for overflow since the run began (fp16 only)
    images_per_second_per_gpu: Optional[float] = None  # per replica: GPU, or CPU process
    warmup_steps: Optional[int] = None  # first steps left out of the rates
    peak_memory_mib: Optional[float] = None  # max over processes; see telemetry.peak_memory_mib
    dataset_bytes: Optional[int] = None  # read from image files by all processes during the split
    macro_f1: Optional[float] = None  # percent, validation only
    bad_images: Optional[int] = None  # unreadable image files met (--bad-images skip; listed in bad_images.csv)
    host_memory_mib: Optional[float] = None  # training process's resident memory at the split's end, max over processes
    image_size: Optional[int] = None  # pixels: side of the split's crops (the epoch's, --progressive-resizing)
    source_bytes: Optional[int] = None  # pulled from DATA's storage by all processes (whole shards copied included)
    cache_bytes: Optional[int] = None  # read from the node-local caches (--data-cache) by all processes

    def bytes_read(self, sources: bool) -> str:
        """The split's bytes for its line; `sources`: and where they came from
        (a run from an object store or through a node-local cache)."""
        if not sources:
            return format_bytes(self.dataset_bytes)
        # More from the source than read in all: a shard's first read on a node copies all of it into the cache.
        return (f"{format_bytes(self.dataset_bytes)} ({format_bytes(self.source_bytes)} pulled from the source, "
                f"{format_bytes(self.cache_bytes)} read from the cache)")

    @staticmethod
    def from_totals(epoch: int, split: str, totals: MetricTotals, timing: SplitTiming, replicas: int,
                    lr: Optional[float], wall_time: float, precision_status: Optional[dict] = None,
                    macro_f1: Optional[float] = None, image_size: Optional[int] = None) -> "EpochMetrics":
        timed_steps = timing.steps - timing.warmup_steps
        images_per_second = totals.timed_count / timing.timed_seconds if timing.timed_seconds > 0 else float("nan")
        return EpochMetrics(
            epoch=epoch, split=split, loss=totals.loss, top1=totals.top1, top5=totals.top5,
            images=totals.count, steps=timing.steps, seconds=timing.seconds,
            images_per_second=images_per_second,
            seconds_per_step=timing.timed_seconds / timed_steps if timed_steps else float("nan"),
            data_wait_fraction=timing.data_wait_fraction,
            lr=lr, wall_time=wall_time,
            loss_scale=(precision_status or {}).get("loss_scale"),
            skipped_steps=(precision_status or {}).get("skipped_steps"),
            images_per_second_per_gpu=images_per_second / replicas,
            warmup_steps=timing.warmup_steps, peak_memory_mib=timing.peak_memory_mib,
            dataset_bytes=totals.file_bytes, macro_f1=macro_f1, bad_images=totals.bad_images,
            host_memory_mib=timing.host_memory_mib, image_size=image_size,
            source_bytes=totals.source_bytes, cache_bytes=totals.cache_bytes,
        )

"""Accuracy and loss as sums and counts.

Sums stay on the device during an epoch (no host sync per step) and are
summed across processes before anything is divided, so a metric is the same
whatever the world size: never an average of per-process averages.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from common.distributed import Context, all_reduce_sum


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Number of samples whose target is among the k highest logits, for each k.

    k larger than the number of classes counts every sample (the target is
    always among all classes), so top-5 is defined on a 3-class problem too.
    Returns a float64 tensor of len(ks) counts on the logits' device.
    """
    num_classes = logits.size(1)
    max_k = min(max(ks), num_classes)
    top = logits.topk(max_k, dim=1, largest=True, sorted=True).indices  # (batch, max_k)
    hits = top.eq(target.view(-1, 1))  # at most one True per row
    cumulative = hits.cumsum(dim=1).sum(dim=0, dtype=torch.float64)  # hits within the first j+1 guesses
    return torch.stack([cumulative[min(k, num_classes) - 1] for k in ks])


class MetricSums:
    """Running sums of one split's loss, top-1 and top-5 hits and sample count."""

    # Positions in the sums vector.
    LOSS, TOP1, TOP5, COUNT = range(4)

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, loss_mean: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch: `loss_mean` is the criterion's mean over the batch."""
        count = target.size(0)
        self.sums[self.LOSS] += loss_mean.detach().double() * count
        self.sums[self.TOP1:self.COUNT] += topk_correct(logits.detach(), target, (1, 5))
        self.sums[self.COUNT] += count

    def totals(self, ctx: Optional[Context] = None) -> "MetricTotals":
        """The sums as Python numbers; with `ctx`, summed over all processes
        first (a collective: every process must call it)."""
        sums = self.sums.clone()
        if ctx is not None:
            all_reduce_sum(sums, ctx)
        loss_sum, top1, top5, count = sums.tolist()
        return MetricTotals(loss_sum=loss_sum, top1_correct=int(top1), top5_correct=int(top5), count=int(count))


@dataclasses.dataclass(frozen=True)
class MetricTotals:
    loss_sum: float
    top1_correct: int
    top5_correct: int
    count: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def top1(self) -> float:
        """Percent."""
        return 100.0 * self.top1_correct / self.count if self.count else float("nan")

    @property
    def top5(self) -> float:
        """Percent."""
        return 100.0 * self.top5_correct / self.count if self.count else float("nan")


@dataclasses.dataclass(frozen=True)
class EpochMetrics:
    """One row of metrics.csv: one split of one epoch, over all processes."""

    epoch: int  # 0-based, as in progress lines and --start-epoch
    split: str  # "train" or "val"
    loss: float
    top1: float  # percent
    top5: float  # percent
    images: int  # images processed by all processes together
    steps: int  # steps (batches) per process
    seconds: float  # wall time of the split
    images_per_second: float  # global: images / seconds
    seconds_per_step: float
    data_wait_fraction: float  # share of the wall time spent waiting for the next batch
    lr: Optional[float]  # learning rate of the epoch's last step (train only)
    wall_time: float  # UNIX seconds at the end of the split
    loss_scale: Optional[float] = None  # fp16 loss scale at the end of the split (mixed precision only)
    skipped_steps: Optional[int] = None  # steps skipped for overflow since the run began (fp16 only)

    @staticmethod
    def from_totals(epoch: int, split: str, totals: MetricTotals, steps: int, seconds: float,
                    data_wait_seconds: float, lr: Optional[float], wall_time: float,
                    precision_status: Optional[dict] = None) -> "EpochMetrics":
        return EpochMetrics(
            epoch=epoch, split=split, loss=totals.loss, top1=totals.top1, top5=totals.top5,
            images=totals.count, steps=steps, seconds=seconds,
            images_per_second=totals.count / seconds if seconds > 0 else float("nan"),
            seconds_per_step=seconds / steps if steps else float("nan"),
            data_wait_fraction=data_wait_seconds / seconds if seconds > 0 else float("nan"),
            lr=lr, wall_time=wall_time,
            loss_scale=(precision_status or {}).get("loss_scale"),
            skipped_steps=(precision_status or {}).get("skipped_steps"),
        )

"""Top-k accuracy and metric sums: exact counts on hand-made logits."""
import dataclasses
import math

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from common.distributed import Context
from common.ports import free_port
from common.meters import EpochMetrics, MetricSums, MetricTotals, SplitTiming, topk_correct

# Four samples, six classes; the comment gives the rank of the target's logit.
LOGITS = torch.tensor([
    [0.1, 0.9, 0.0, 0.2, 0.3, 0.4],  # target 1: 1st
    [0.8, 0.7, 0.1, 0.0, 0.2, 0.3],  # target 1: 2nd
    [0.6, 0.5, 0.4, 0.3, 0.2, 0.1],  # target 5: 6th (last)
    [0.5, 0.6, 0.7, 0.8, 0.2, 0.9],  # target 0: 5th
])
TARGET = torch.tensor([1, 1, 5, 0])


def test_topk_counts_exact():
    counts = topk_correct(LOGITS, TARGET, ks=(1, 2, 5, 6))
    assert counts.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert counts.dtype == torch.float64


def test_topk_with_k_above_class_count_counts_every_sample():
    logits = torch.tensor([[0.2, 0.1, 0.7], [0.9, 0.05, 0.05]])
    target = torch.tensor([1, 2])  # both last or second-to-last: wrong at top-1
    assert topk_correct(logits, target, ks=(1, 5)).tolist() == [0.0, 2.0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 9), st.integers(0, 10_000))
def test_topk_matches_rank_definition(batch, classes, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, classes, generator=generator)  # continuous: no ties
    target = torch.randint(0, classes, (batch,), generator=generator)
    # rank of the target = number of classes with a strictly higher logit
    ranks = (logits > logits.gather(1, target.view(-1, 1))).sum(dim=1)
    for k in (1, 2, 5):
        assert topk_correct(logits, target, ks=(k,)).item() == (ranks < k).sum().item()


def test_metric_sums_are_sums_not_averages_of_averages():
    sums = MetricSums(torch.device("cpu"))
    # Batch of 4 with mean loss 2.0 (top-1: 1 hit, top-5: 3 hits), then batch of 1 with loss 7.0 (a top-1 hit).
    sums.add(torch.tensor(2.0), LOGITS, TARGET)
    sums.add(torch.tensor(7.0), torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]), torch.tensor([1]))
    totals = sums.totals()
    assert totals == MetricTotals(loss_sum=15.0, top1_correct=2, top5_correct=4, count=5, timed_count=5)
    assert totals.loss == 3.0  # (4 x 2 + 1 x 7) / 5, not (2 + 7) / 2
    assert totals.top1 == 40.0 and totals.top5 == 80.0


def test_totals_with_world_of_one_is_the_local_sum():
    sums = MetricSums(torch.device("cpu"))
    sums.add(torch.tensor(1.5), LOGITS, TARGET)
    ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert sums.totals(ctx) == sums.totals()
    assert sums.totals(ctx).count == 4


def test_epoch_metrics_rates_leave_out_the_warm_up():
    # 4 steps of 2 images on each of 2 processes (16 images); the first step is warm-up, so the rates
    # cover 3 steps (12 images) in 0.5 s of a 0.75 s split, a quarter of which went waiting for data.
    totals = MetricTotals(loss_sum=40.0, top1_correct=12, top5_correct=16, count=16, timed_count=12,
                          file_bytes=123_456)
    timing = SplitTiming(steps=4, warmup_steps=1, seconds=0.75, timed_seconds=0.5, data_wait_seconds=0.25,
                         all_timed_seconds=1.0, peak_memory_mib=42.0)
    metrics = EpochMetrics.from_totals(2, "train", totals, timing, replicas=2, lr=0.1, wall_time=1.0)
    assert (metrics.loss, metrics.top1, metrics.top5) == (2.5, 75.0, 100.0)
    assert (metrics.images, metrics.steps, metrics.seconds, metrics.warmup_steps) == (16, 4, 0.75, 1)
    assert metrics.images_per_second == 24.0 and metrics.images_per_second_per_gpu == 12.0
    assert metrics.seconds_per_step == 0.5 / 3
    assert metrics.data_wait_fraction == 0.25
    assert (metrics.dataset_bytes, metrics.peak_memory_mib, metrics.macro_f1) == (123_456, 42.0, None)
    # The same split in two parts (a resume after step 2): the sums and times add up to the same row.
    first = SplitTiming(steps=2, warmup_steps=1, seconds=0.5, timed_seconds=0.25, data_wait_seconds=0.125,
                        all_timed_seconds=0.5, peak_memory_mib=40.0)
    second = SplitTiming(steps=2, warmup_steps=0, seconds=0.25, timed_seconds=0.25, data_wait_seconds=0.125,
                         all_timed_seconds=0.5, peak_memory_mib=42.0)
    halves = (MetricTotals(loss_sum=15.0, top1_correct=5, top5_correct=8, count=8, timed_count=4, file_bytes=56),
              MetricTotals(loss_sum=25.0, top1_correct=7, top5_correct=8, count=8, timed_count=8, file_bytes=123_400))
    joined = EpochMetrics.from_totals(2, "train", halves[0].plus(halves[1]), first.plus(second), replicas=2, lr=0.1,
                                      wall_time=1.0)
    assert joined == metrics
    empty = MetricTotals(0.0, 0, 0, 0)
    assert math.isnan(empty.top1) and math.isnan(empty.loss)


def test_warm_up_steps_and_bytes_are_counted_on_the_host():
    sums = MetricSums(torch.device("cpu"))
    sums.add(torch.tensor(2.0), LOGITS, TARGET, file_bytes=1000, timed=False)  # a warm-up step
    sums.add(torch.tensor(7.0), torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]), torch.tensor([1]), file_bytes=24)
    totals = sums.totals()
    assert (totals.count, totals.timed_count, totals.file_bytes) == (5, 1, 1024)


def _sum_over_two_processes(rank, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = Context(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    sums = MetricSums(torch.device("cpu"), num_classes=6)
    if rank == 0:  # the two batches of test_metric_sums_are_sums_not_averages_of_averages, one per process
        sums.add(torch.tensor(2.0), LOGITS, TARGET, file_bytes=1000, bad_images=2, source_bytes=70_000,
                 cache_bytes=1000)
    else:
        sums.add(torch.tensor(7.0), torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]), torch.tensor([1]), file_bytes=24,
                 timed=False, source_bytes=24)
        # A skipped step: its reads count, nothing else.
        sums.add_files(file_bytes=3, bad_images=1, large_images=2, cache_bytes=3)
    totals = sums.totals(ctx)
    confusion = sums.class_report(ctx).confusion
    (out_dir / f"rank{rank}.txt").write_text(repr((dataclasses.astuple(totals), confusion.tolist())))
    dist.destroy_process_group()


def test_totals_are_summed_across_processes(tmp_path):
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_sum_over_two_processes, args=(port, tmp_path), nprocs=2, start_method="fork")
    # (4 x 2.0 + 1 x 7.0, top-1, top-5, count, timed images, bytes, unreadable images, images above Pillow's
    # decompression-bomb limit, bytes from the source (a shard copied whole), bytes from the cache): one epoch's totals.
    confusion = np.zeros((6, 6), dtype=int)
    for true, predicted in zip(TARGET.tolist() + [1], LOGITS.argmax(dim=1).tolist() + [1]):
        confusion[true, predicted] += 1
    expected = repr(((15.0, 2, 4, 5, 4, 1027, 3, 2, 70_024, 1003), confusion.tolist()))
    assert (tmp_path / "rank0.txt").read_text() == (tmp_path / "rank1.txt").read_text() == expected


@settings(max_examples=40, deadline=None)
@given(classes=st.integers(2, 9), batches=st.lists(st.integers(1, 12), min_size=1, max_size=4), seed=st.integers(0, 10**6))
def test_per_class_report_equals_scikit_learns(classes, batches, seed):
    """Issue 21: precision, recall, F1 per class, their macro averages and the
    confusion matrix, counted batch by batch on the device, equal
    scikit-learn's precision_recall_fscore_support and confusion_matrix, also
    with classes that have no image or are never predicted."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    from common.distributed import single_process

    generator = torch.Generator().manual_seed(seed)
    sums = MetricSums(torch.device("cpu"), num_classes=classes)
    targets, predictions = [], []
    for size in batches:
        # A random permutation per row: distinct logits, so top-1 has no ties to break.
        logits = torch.stack([torch.randperm(classes, generator=generator) for _ in range(size)]).float()
        target = torch.randint(0, classes, (size,), generator=generator)
        sums.add(torch.tensor(1.0), logits, target)
        targets += target.tolist()
        predictions += logits.argmax(dim=1).tolist()
    report = sums.class_report(single_process("cpu"))
    labels = list(range(classes))
    precision, recall, f1, support = precision_recall_fscore_support(targets, predictions, labels=labels,
                                                                      zero_division=0)
    assert np.allclose(report.precision, 100 * precision) and np.allclose(report.recall, 100 * recall)
    assert np.allclose(report.f1, 100 * f1) and report.support.tolist() == support.tolist()
    assert report.confusion.tolist() == confusion_matrix(targets, predictions, labels=labels).tolist()
    present = sorted(set(targets))  # the macro averages are over the classes that have images
    macro = precision_recall_fscore_support(targets, predictions, labels=present, average="macro", zero_division=0)
    assert math.isclose(report.macro_f1, 100 * macro[2], rel_tol=1e-9)
    assert math.isclose(report.macro(report.precision), 100 * macro[0], rel_tol=1e-9)
    assert math.isclose(report.micro, 100 * np.mean(np.array(targets) == np.array(predictions)), rel_tol=1e-9)

"""LR schedules: exact values of the linear scaling rule, warm-up, step and cosine."""
import math

import pytest

from common.errors import UsageError
from common.schedules import LRSchedule, scaled_lr


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 256) == 0.1
    assert scaled_lr(0.1, 1024) == 0.4
    assert scaled_lr(0.1, 64) == 0.025
    assert scaled_lr(0.1, 208 * 64) == pytest.approx(5.2)  # the upstream 64-GPU run: 0.1 x 13312/256


def test_a_scaled_rate_that_overflows_is_the_users_mistake_in_one_line():
    """--lr is checked to be a positive float, yet 1e308 x 512/256 is inf: training would run on NaN
    weights until the first checkpoint refused them."""
    assert scaled_lr(1e300, 512) == 2e300
    with pytest.raises(UsageError, match=r"^argument --lr: 1e\+308 scaled to the global batch of 512 is inf, not a "
                                         r"usable rate$"):
        scaled_lr(1e308, 512)


def test_step_schedule_multiplies_by_a_tenth_at_30_60_80():
    schedule = LRSchedule(peak_lr=0.1, epochs=90)
    expected = {0: 0.1, 29: 0.1, 30: 0.01, 59: 0.01, 60: 0.001, 79: 0.001, 80: 0.0001, 89: 0.0001}
    for epoch, lr in expected.items():
        for step in (0, 99):
            assert schedule.lr(epoch, step, 100) == pytest.approx(lr, rel=1e-12)


def test_step_schedule_custom_milestones():
    schedule = LRSchedule(peak_lr=1.0, epochs=10, milestones=(2, 5))
    assert [schedule.lr(epoch, 0, 10) for epoch in range(7)] == pytest.approx([1, 1, 0.1, 0.1, 0.1, 0.01, 0.01])


def test_cosine_schedule_values():
    schedule = LRSchedule(peak_lr=0.4, epochs=10, kind="cosine")
    assert schedule.lr(0, 0, 4) == pytest.approx(0.4)  # start: the peak
    assert schedule.lr(5, 0, 4) == pytest.approx(0.2)  # half-way: half the peak
    assert schedule.lr(2, 2, 4) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 0.25)))  # 2.5 of 10 epochs
    assert schedule.lr(9, 3, 4) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 9.75 / 10)))  # the last step
    rates = [schedule.lr(epoch, step, 4) for epoch in range(10) for step in range(4)]
    assert all(a > b for a, b in zip(rates, rates[1:]))  # strictly decreasing, per step


def test_linear_warmup_per_step_then_schedule():
    # 2 warm-up epochs x 4 steps: the rate climbs 1/8, 2/8, ... 8/8 of the peak, per step.
    schedule = LRSchedule(peak_lr=0.8, epochs=10, kind="step", milestones=(5,), warmup_epochs=2)
    warm = [schedule.lr(epoch, step, 4) for epoch in range(2) for step in range(4)]
    assert warm == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert schedule.lr(2, 0, 4) == pytest.approx(0.8)
    assert schedule.lr(5, 0, 4) == pytest.approx(0.08)


def test_cosine_starts_after_warmup():
    schedule = LRSchedule(peak_lr=1.0, epochs=6, kind="cosine", warmup_epochs=1)
    assert schedule.lr(0, 1, 2) == pytest.approx(1.0)  # the last warm-up step reaches the peak
    assert schedule.lr(1, 0, 2) == pytest.approx(1.0)  # cosine starts at the peak
    assert schedule.lr(3, 1, 2) == pytest.approx(0.5)  # 2.5 of the 5 cosine epochs: half


def test_fractional_warmup_rounds_to_steps():
    schedule = LRSchedule(peak_lr=1.0, epochs=3, warmup_epochs=0.5)
    assert [schedule.lr(0, step, 4) for step in range(4)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_unknown_kind_rejected():
    with pytest.raises(ValueError):
        LRSchedule(peak_lr=0.1, epochs=1, kind="onecycle")


def test_cosine_with_warmup_over_the_whole_run_never_drops_to_zero():
    schedule = LRSchedule(peak_lr=0.1, epochs=2, kind="cosine", warmup_epochs=2)
    rates = [schedule.lr(epoch, step, 4) for epoch in range(2) for step in range(4)]
    assert rates == pytest.approx([0.1 * (index + 1) / 8 for index in range(8)])

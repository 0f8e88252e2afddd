"""slime.backends.lr_schedule: warm-up, constant / linear / cosine decay, floor; values worked out by hand."""

from __future__ import annotations

import math

import pytest

from slime.backends.config import OptimizerConfig
from slime.backends.lr_schedule import LRSchedule
from slime.utils.config import ConfigError


def test_constant_without_warmup_is_flat():
    schedule = LRSchedule(lr=3e-6)
    assert [schedule(s) for s in (0, 1, 1000)] == [3e-6, 3e-6, 3e-6]


def test_warmup_reaches_peak_on_its_last_step_then_constant():
    # W = 4: steps 0..3 run at 1/4, 2/4, 3/4, 4/4 of the peak, then stay there.
    schedule = LRSchedule(lr=1.0, warmup_steps=4)
    assert [schedule(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0], abs=0)


def test_linear_decay_by_hand():
    # W = 2, D = 6, lr 1.0 -> min 0.2: warm-up 0.5, 1.0; then progress (s - 2) / 4.
    schedule = LRSchedule(lr=1.0, min_lr=0.2, decay_style="linear", warmup_steps=2, decay_steps=6)
    expected = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]
    assert [schedule(s) for s in range(9)] == pytest.approx(expected, rel=1e-12)


def test_cosine_decay_by_hand():
    # No warm-up, D = 4, lr 2.0 -> min 0.0: 2 * (1 + cos(pi * s / 4)) / 2.
    schedule = LRSchedule(lr=2.0, min_lr=0.0, decay_style="cosine", decay_steps=4)
    half_sqrt2 = math.sqrt(2) / 2
    expected = [2.0, 1.0 + half_sqrt2, 1.0, 1.0 - half_sqrt2, 0.0, 0.0]
    assert [schedule(s) for s in range(6)] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cosine_floor_at_min_lr():
    schedule = LRSchedule(lr=1e-5, min_lr=1e-6, decay_style="cosine", warmup_steps=1, decay_steps=3)
    # step 1: progress 0 -> peak; step 2: progress 0.5 -> midway; step >= 3: floor.
    assert schedule(1) == pytest.approx(1e-5)
    assert schedule(2) == pytest.approx(1e-6 + 0.5 * 9e-6)
    assert schedule(3) == schedule(50) == 1e-6


def test_from_config_defaults_decay_to_total_steps_and_prefers_lr_decay_iters():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear")
    assert LRSchedule.from_config(cfg, total_steps=10)(5) == pytest.approx(0.5)
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_iters=4)
    assert LRSchedule.from_config(cfg, total_steps=10)(2) == pytest.approx(0.5)


def test_decay_without_horizon_names_the_flags():
    cfg = OptimizerConfig(lr=1.0, lr_decay_style="cosine")
    with pytest.raises(ConfigError, match="--lr-decay-iters"):
        LRSchedule.from_config(cfg, total_steps=None)


def test_decay_shorter_than_warmup_raises():
    with pytest.raises(ConfigError, match="must exceed --lr-warmup-iters"):
        LRSchedule(lr=1.0, decay_style="linear", warmup_steps=5, decay_steps=5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=0.0), "--lr must be > 0"),
        (dict(lr=1.0, min_lr=2.0), "--min-lr"),
        (dict(lr=1.0, warmup_steps=-1), "--lr-warmup-iters"),
        (dict(lr=1.0, decay_style="step"), "--lr-decay-style"),
    ],
)
def test_bad_values_raise(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LRSchedule(**kwargs)


def test_negative_step_raises():
    with pytest.raises(ValueError, match=">= 0"):
        LRSchedule(lr=1.0)(-1)

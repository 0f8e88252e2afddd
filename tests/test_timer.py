import time
import types

import pytest

from slime.utils import timer
from slime.utils.timer import Timer, timed


def _fake_clock(monkeypatch, readings):
    """Replace the timer module's clock (only there) by one returning ``readings`` in order."""
    readings = iter(readings)
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))


def test_timed_records_a_known_sleep():
    perf = {}
    outer_start = time.perf_counter()
    with timed("rollout", perf):
        time.sleep(0.2)
    outer_s = time.perf_counter() - outer_start

    assert list(perf) == ["perf/rollout_time_s"]
    assert 0.2 <= perf["perf/rollout_time_s"] <= outer_s
    assert perf["perf/rollout_time_s"] < 2.0


def test_timer_uses_the_monotonic_clock(monkeypatch):
    _fake_clock(monkeypatch, [100.0, 102.5])  # no time.time: the wall clock can jump

    perf = {}
    with Timer("train", perf) as t:
        pass
    assert t.elapsed_s == 2.5
    assert perf == {"perf/train_time_s": 2.5}


def test_same_phase_twice_in_a_step_adds_up(monkeypatch):
    _fake_clock(monkeypatch, [0.0, 1.25, 10.0, 10.5])

    perf = {"perf/rollout_time_s": 4.0, "rollout/reward_mean": 0.3}
    with timed("sync", perf):
        pass
    with timed("sync", perf):
        pass
    assert perf == {"perf/rollout_time_s": 4.0, "rollout/reward_mean": 0.3, "perf/sync_time_s": 1.75}


def test_time_is_recorded_when_the_phase_raises(monkeypatch):
    _fake_clock(monkeypatch, [3.0, 3.75])

    perf = {}
    with pytest.raises(RuntimeError, match="engine died"):
        with timed("eval", perf):
            raise RuntimeError("engine died")
    assert perf == {"perf/eval_time_s": 0.75}


def test_timer_without_store_only_sets_elapsed():
    with Timer("save") as t:
        time.sleep(0.05)
    assert 0.05 <= t.elapsed_s < 2.0
    assert t.key == "perf/save_time_s"


@pytest.mark.parametrize("phase", ["", "roll out", "train\n"])
def test_bad_phase_name_raises(phase):
    with pytest.raises(ValueError, match="phase"):
        timed(phase, {})

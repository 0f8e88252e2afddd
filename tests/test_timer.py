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


def test_micro_batch_clock_gives_each_micro_batch_its_seconds(monkeypatch):
    _fake_clock(monkeypatch, [10.0, 11.5, 14.0, 14.25])
    clock = timer.MicroBatchClock("cpu")
    assert clock.seconds() == []  # nothing marked yet
    for _ in range(3):
        clock.mark()
    clock.stop()
    assert clock.seconds() == [1.5, 2.5, 0.25]


def test_micro_batch_metrics_by_hand():
    # five micro-batches of 100 tokens: the first (the quarter, at least one) takes 2 s, the rest 1 s each
    got = timer.micro_batch_metrics([2.0, 1.0, 1.0, 1.0, 1.0], [100] * 5)
    assert got == {"perf/micro_batch_first_s": 2.0, "perf/micro_batch_median_s": 1.0, "perf/micro_batch_max_s": 2.0,
                   "perf/micro_batch_first_quarter_tokens_per_s": 50.0, "perf/micro_batch_rest_tokens_per_s": 100.0}
    # eight: the quarter is two; an even count's median is the mean of the middle two
    got = timer.micro_batch_metrics([3.0, 1.0, 2.0, 2.0, 4.0, 1.0, 1.0, 2.0], [60, 20, 40, 40, 80, 20, 20, 40])
    assert got["perf/micro_batch_median_s"] == 2.0 and got["perf/micro_batch_max_s"] == 4.0
    assert got["perf/micro_batch_first_quarter_tokens_per_s"] == 80 / 4.0
    assert got["perf/micro_batch_rest_tokens_per_s"] == 240 / 12.0
    one = timer.micro_batch_metrics([0.5], [10])  # a single micro-batch has no rest
    assert one["perf/micro_batch_first_quarter_tokens_per_s"] == 20.0 and "perf/micro_batch_rest_tokens_per_s" not in one
    assert timer.micro_batch_metrics([], []) == {}
    with pytest.raises(ValueError, match="2 micro-batch times for 3 micro-batches"):
        timer.micro_batch_metrics([1.0, 1.0], [1, 2, 3])


@pytest.mark.gpu
def test_micro_batch_clock_times_queued_gpu_work_without_waiting_for_it():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    clock = timer.MicroBatchClock(torch.device("cuda"))
    cycles = 50_000_000  # torch.cuda._sleep spins this many GPU clock cycles (tens of milliseconds)
    torch.cuda.synchronize()
    host = time.perf_counter()
    for factor in (1, 2, 1):
        clock.mark()
        torch.cuda._sleep(cycles * factor)
    clock.stop()
    queued_s = time.perf_counter() - host
    first, second, third = clock.seconds()
    assert queued_s < first  # marks are events: the host did not wait for the kernels
    assert second == pytest.approx(2 * first, rel=0.2) and third == pytest.approx(first, rel=0.2)

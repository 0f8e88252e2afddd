"""The request scheduler without Ray: plain-Python engines on a simulated clock.

:class:`FakePool` is an :class:`slime.rollout.scheduler.EnginePool` whose calls take ``call_s`` seconds
of a fake clock (``wait`` jumps to the first call that finishes, ties by send order), so every schedule
here is deterministic and none waits for real time.  Expected schedules are worked out by hand from the
windows that the README states (one engine: its capacity; ``E`` engines and ``N`` requests:
``min(capacity, max(1, ceil(ceil(N / E) / 2)))``), the calls' durations and the water-filling order.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest

from slime.rollout.engines.base import GenerateOutput, GenerateRequest, SamplingParams
from slime.rollout.scheduler import (
    MAX_ATTEMPTS,
    EngineDown,
    EngineError,
    EngineState,
    RequestScheduler,
    balance_windows,
)


@dataclasses.dataclass
class StandIn:
    """One engine: each call takes ``call_s`` seconds; its calls numbered in ``down_on`` (1 = its first call,
    counted across restarts) find its server gone; those in ``hangs_on`` never return, and the engine then
    reports itself unhealthy."""

    call_s: float = 1.0
    capacity: int = 2
    per_call: int = 2
    down_on: frozenset[int] = frozenset()
    hangs_on: frozenset[int] = frozenset()
    answers: str = "right"  # "right", "one short" (one output too few), "other rid", "refuses"


@dataclasses.dataclass
class Call:
    engine: int
    number: int
    rids: list[str]
    sent_at: float
    done_at: float


class FakePool:
    """The engines as the scheduler sees them; records every send, read and fault."""

    def __init__(self, engines: list[StandIn]):
        self.engines = engines
        self.now = 0.0
        self.states = [EngineState.SERVING] * len(engines)
        self.calls: list[Call] = []
        self.numbers = [0] * len(engines)
        self.in_flight = [0] * len(engines)
        self.most_in_flight = [0] * len(engines)
        self.read: list[int] = []  # calls whose result was read
        self.answered: collections.Counter = collections.Counter()  # rid -> outputs handed out
        self.failed: list[tuple[int, str, BaseException | None]] = []
        self.events: list[str] = []
        self.restart_error: Exception | None = None

    @property
    def limits(self) -> list[tuple[int, int]]:
        return [(e.capacity, e.per_call) for e in self.engines]

    def sends(self) -> list[tuple[float, int, list[str]]]:
        return [(c.sent_at, c.engine, c.rids) for c in self.calls]

    # -- EnginePool

    def state(self, engine: int) -> EngineState:
        return self.states[engine]

    def describe(self, engine: int) -> str:
        return f"engine {engine} (stand-in)"

    def submit(self, engine: int, requests: list[GenerateRequest]) -> int:
        assert self.states[engine] is EngineState.SERVING, f"a request went to engine {engine} in {self.states[engine]}"
        assert 1 <= len(requests) <= self.engines[engine].per_call
        self.numbers[engine] += 1
        spec = self.engines[engine]
        done_at = math.inf if self.numbers[engine] in spec.hangs_on else self.now + spec.call_s
        self.calls.append(Call(engine, self.numbers[engine], [r.rid for r in requests], self.now, done_at))
        self.in_flight[engine] += len(requests)
        self.most_in_flight[engine] = max(self.most_in_flight[engine], self.in_flight[engine])
        return len(self.calls) - 1

    def wait(self, calls: list[int], timeout_s: float) -> int | None:
        first = min(calls, key=lambda c: (self.calls[c].done_at, c))
        if self.calls[first].done_at > self.now + timeout_s:
            self.now += timeout_s
            return None
        self.now = max(self.now, self.calls[first].done_at)
        self.in_flight[self.calls[first].engine] -= len(self.calls[first].rids)
        return first

    def result(self, call: int) -> list[GenerateOutput]:
        self.read.append(call)
        c, spec = self.calls[call], self.engines[self.calls[call].engine]
        if c.number in spec.down_on:
            cause = ConnectionResetError(f"server of engine {c.engine} died (stand-in)")
            raise EngineDown(f"EngineUnavailableError: {cause}", cause)
        if spec.answers == "refuses":
            raise ValueError(f"the server refused {c.rids[0]} (stand-in)")
        rids = c.rids[:-1] if spec.answers == "one short" else c.rids
        outputs = [GenerateOutput(f"{rid} by {c.engine}", [1], [0.0], "stop", 1,
                                  rid="x" if spec.answers == "other rid" else rid) for rid in rids]
        self.answered.update(rids)
        return outputs

    def unhealthy(self, engines: set[int], timeout_s: float) -> dict[int, str]:
        self.events.append(f"health check of {sorted(engines)} at {self.now:g}")
        hung = {c.engine for c in self.calls if c.done_at == math.inf}
        return {e: "reported itself unhealthy" for e in sorted(engines) if e in hung}

    def fail(self, engine: int, why: str, cause: BaseException | None) -> None:
        self.failed.append((engine, why, cause))
        self.states[engine] = EngineState.RESTARTING
        self.in_flight[engine] = 0

    def wait_for_restarts(self) -> None:
        for engine, state in enumerate(self.states):
            if state is EngineState.RESTARTING:
                if self.restart_error is not None:
                    self.states[engine] = EngineState.DOWN
                    raise self.restart_error
                self.states[engine] = EngineState.RESTARTED
                self.events.append(f"engine {engine} restarted")

    def abort(self, engines: set[int]) -> None:
        self.events.append(f"abort {sorted(engines)} at {self.now:g}")

    def weights_updated(self) -> None:
        self.states = [EngineState.SERVING if s is EngineState.RESTARTED else s for s in self.states]
        self.events.append("weights updated")


def _requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"prompt {i}", [], SamplingParams(max_new_tokens=1), rid=f"r{i}") for i in range(n)]


def _rids(*numbers: int) -> list[str]:
    return [f"r{i}" for i in numbers]


def _generate(pool: FakePool, n: int, scheduler: RequestScheduler | None = None) -> list[GenerateOutput]:
    scheduler = scheduler or RequestScheduler(pool)
    pool.answered.clear()
    outputs = scheduler.generate(_requests(n), pool.limits)
    assert [out.rid for out in outputs] == _rids(*range(n))  # in request order
    assert [out.text.split(" by ")[0] for out in outputs] == _rids(*range(n))
    assert all(pool.answered[rid] == 1 for rid in _rids(*range(n)))  # each request answered exactly once
    return outputs


@pytest.mark.parametrize(
    "num_requests, capacities, expected",
    [
        (4, [2, 2], [1, 1]),  # the step fits at once: half an even share each
        (16, [2, 2], [2, 2]),  # capacity binds
        (5, [2, 2], [2, 2]),  # even share 3, half of it rounded up
        (512, [512, 512], [128, 128]),  # two SGLang engines of concurrency 512, a 512-sample step
        (512, [512] * 4, [64] * 4),
        (512, [512], [512]),  # one engine: its full capacity, as alone
        (5, [32], [32]),
        (3, [2, 2, 2], [1, 1, 1]),  # at least one request in flight
        (16, [2, 32], [2, 4]),
        (0, [2, 2], [1, 1]),
    ],
)
def test_balance_windows(num_requests, capacities, expected):
    assert balance_windows(num_requests, capacities) == expected


def test_a_slow_engine_serves_fewer_requests():
    # Windows [2, 2] (even share 8, half 4, capacity 2).  Engine 0 takes 1 s per call, engine 1 3.5 s: engine 0
    # returns at 1, 2, 3 and takes 2 more each time; engine 1 returns at 3.5 and takes r10 r11; engine 0 takes the
    # last four at 4 and 5.  Contiguous halves would have taken 4 slow calls (14 s).
    pool = FakePool([StandIn(call_s=1.0), StandIn(call_s=3.5)])
    outputs = _generate(pool, 16)
    assert pool.sends() == [
        (0.0, 0, _rids(0, 1)), (0.0, 1, _rids(2, 3)), (1.0, 0, _rids(4, 5)), (2.0, 0, _rids(6, 7)),
        (3.0, 0, _rids(8, 9)), (3.5, 1, _rids(10, 11)), (4.0, 0, _rids(12, 13)), (5.0, 0, _rids(14, 15)),
    ]  # fmt: skip
    assert [out.engine_index for out in outputs] == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert pool.now == 7.0 and pool.most_in_flight == [2, 2]
    assert pool.failed == [] and pool.events == []


def test_a_slow_engine_serves_fewer_also_when_the_step_fits_in_the_engines_at_once():
    # 4 requests on two engines of capacity 2: windows [1, 1], so r0 and r1 start and the fast engine 0 takes r2
    # at 1 s and r3 at 2 s while engine 1 still runs r1.
    pool = FakePool([StandIn(call_s=1.0), StandIn(call_s=5.0)])
    outputs = _generate(pool, 4)
    assert pool.sends() == [(0.0, 0, ["r0"]), (0.0, 1, ["r1"]), (1.0, 0, ["r2"]), (2.0, 0, ["r3"])]
    assert [out.engine_index for out in outputs] == [0, 1, 0, 0]


def test_windows_and_calls_as_the_readme_states():
    # Two engines of capacity 512, calls of at most 32, a 512-request step: windows of 128 each, so 4 calls of 32 to
    # each engine at the start and 256 requests left in the queue; no engine ever holds more than 128.
    pool = FakePool([StandIn(capacity=512, per_call=32), StandIn(capacity=512, per_call=32)])
    _generate(pool, 512)
    first = [(engine, rids[0], len(rids)) for sent_at, engine, rids in pool.sends() if sent_at == 0.0]
    assert first == [(0, f"r{32 * k}", 32) for k in range(4)] + [(1, f"r{128 + 32 * k}", 32) for k in range(4)]
    assert pool.most_in_flight == [128, 128] and len(pool.calls) == 512 // 32

    # One engine: its full capacity, in batches one after the other (capacity 2: 2, 2 and 1).
    pool = FakePool([StandIn(capacity=2, per_call=2)])
    _generate(pool, 5)
    assert pool.sends() == [(0.0, 0, _rids(0, 1)), (1.0, 0, _rids(2, 3)), (2.0, 0, ["r4"])]

    # A continuous-batching engine (calls of one request, 4 at once) gets 4 calls at the start.
    pool = FakePool([StandIn(capacity=4, per_call=1)])
    _generate(pool, 8)
    assert [(t, rids) for t, _, rids in pool.sends()] == [(0.0, [f"r{i}"]) for i in range(4)] + [
        (1.0, [f"r{i}"]) for i in range(4, 8)]  # fmt: skip

    # Water-filling, least free first: windows [2, 4] (capacities 2 and 32, 16 requests); engine 0 (room 2) takes
    # min(2, ceil(16 / 2)) = 2, engine 1 (room 4) min(4, ceil(14 / 1)) = 4.
    pool = FakePool([StandIn(capacity=2, per_call=1), StandIn(capacity=32, per_call=1)])
    _generate(pool, 16)
    assert [(engine, rids) for t, engine, rids in pool.sends() if t == 0.0] == [
        (0, ["r0"]), (0, ["r1"]), (1, ["r2"]), (1, ["r3"]), (1, ["r4"]), (1, ["r5"])]  # fmt: skip


def test_a_dead_engines_requests_go_elsewhere_and_it_serves_again_after_the_next_sync():
    # Windows [2, 2].  Engine 1 (1.4 s a call) serves r2 r3, then dies on its second call (r6 r7, sent at 1.4,
    # failing at 2.8); r6 r7 go back to the front of the queue, ahead of r10 r11, and engine 0 serves them at 3.
    pool = FakePool([StandIn(call_s=1.0), StandIn(call_s=1.4, down_on=frozenset({2}))])
    scheduler = RequestScheduler(pool)
    scheduler.resync = lambda: pytest.fail("a survivor serves: no re-sync")
    outputs = _generate(pool, 12, scheduler)
    assert pool.sends() == [
        (0.0, 0, _rids(0, 1)), (0.0, 1, _rids(2, 3)), (1.0, 0, _rids(4, 5)), (1.4, 1, _rids(6, 7)),
        (2.0, 0, _rids(8, 9)), (3.0, 0, _rids(6, 7)), (4.0, 0, _rids(10, 11)),
    ]  # fmt: skip
    assert [out.engine_index for out in outputs] == [0, 0, 1, 1] + [0] * 8
    (engine, why, cause), = pool.failed
    assert engine == 1 and "server of engine 1 died (stand-in)" in why and isinstance(cause, ConnectionResetError)
    assert dict(scheduler.fault_counts) == {"requests_retried": 2}
    # generate() returned after the restart; the engine waits for the weights and gets nothing until then.
    assert pool.events == ["engine 1 restarted"] and pool.states[1] is EngineState.RESTARTED
    sent = len(pool.calls)
    _generate(pool, 4, scheduler)
    assert {engine for _, engine, _ in pool.sends()[sent:]} == {0}
    pool.weights_updated()
    sent = len(pool.calls)
    _generate(pool, 4, scheduler)
    assert {engine for _, engine, _ in pool.sends()[sent:]} == {0, 1}


def test_the_calls_of_a_dead_engine_still_in_flight_are_requeued_and_never_read():
    # 8 requests, calls of one request, windows [2, 2]: r0 r1 to engine 0 (1 s a call), r2 r3 to engine 1 (2 s a
    # call).  At 2 s engine 1's first call (r2) fails; its second (r3), which would return at 2 s as well, is
    # abandoned with it: both go back to the queue (r3 ahead of r2), and engine 0 serves them.
    pool = FakePool([StandIn(call_s=1.0, per_call=1), StandIn(call_s=2.0, per_call=1, down_on=frozenset({1}))])
    outputs = _generate(pool, 8)
    engine_1_calls = [i for i, c in enumerate(pool.calls) if c.engine == 1]
    assert [pool.calls[i].rids for i in engine_1_calls] == [["r2"], ["r3"]]
    assert engine_1_calls[0] in pool.read and engine_1_calls[1] not in pool.read
    assert [rids for t, engine, rids in pool.sends() if t == 2.0] == [["r3"], ["r2"]]
    assert all(out.engine_index == 0 for out in outputs)
    assert sum(c.rids.count("r3") for c in pool.calls) == 2 and pool.answered["r3"] == 1


def test_an_engine_that_stops_answering_is_found_by_the_health_monitor():
    # Windows [1, 1].  Engine 1's first call (r1) never returns.  Engine 0 serves r0, r2, r3 by 3 s; after
    # monitor_s = 10 s without an answer (at 13 s) the engines with requests in flight are checked, engine 1 is
    # unhealthy, and r1 goes to engine 0 (done at 14 s).
    pool = FakePool([StandIn(call_s=1.0), StandIn(call_s=1.0, hangs_on=frozenset({1}))])
    scheduler = RequestScheduler(pool, monitor_s=10.0)
    outputs = _generate(pool, 4, scheduler)
    assert [out.engine_index for out in outputs] == [0, 0, 0, 0]
    assert pool.events == ["health check of [1] at 13", "engine 1 restarted"]
    assert pool.failed == [(1, "reported itself unhealthy", None)] and pool.now == 14.0
    assert pool.sends()[-1] == (13.0, 0, ["r1"]) and scheduler.fault_counts["requests_retried"] == 1

    # A slow but healthy engine keeps its requests: checked at 10 s, answered at 25 s.
    pool = FakePool([StandIn(call_s=25.0)])
    outputs = _generate(pool, 2, RequestScheduler(pool, monitor_s=10.0))
    assert pool.events == ["health check of [0] at 10", "health check of [0] at 20"] and pool.failed == []
    assert pool.now == 25.0 and [out.engine_index for out in outputs] == [0, 0]


def test_the_only_engine_dies_and_the_rest_is_served_after_a_mid_rollout_re_sync():
    # One engine of capacity 2: r0 r1 at 0 s; its second call (r2 r3) dies at 2 s; the scheduler waits for the
    # restart, the hook re-syncs, and the restarted engine serves r2 r3, r4 r5, r6.
    pool = FakePool([StandIn(down_on=frozenset({2}))])
    scheduler = RequestScheduler(pool)
    seen = []

    def resync():
        seen.append(pool.states[0])
        pool.weights_updated()

    scheduler.resync = resync
    outputs = _generate(pool, 7, scheduler)
    assert seen == [EngineState.RESTARTED]  # called once, after the restart
    assert [rids for _, _, rids in pool.sends()] == [_rids(0, 1), _rids(2, 3), _rids(2, 3), _rids(4, 5), ["r6"]]
    assert [out.engine_index for out in outputs] == [0] * 7
    assert dict(scheduler.fault_counts) == {"requests_retried": 2, "mid_rollout_resyncs": 1}
    assert pool.events == ["engine 0 restarted", "weights updated"]


def test_a_request_is_sent_at_most_max_attempts_times():
    # The only engine dies on every call: call 1 fails (attempt 1), re-sync, call 2 fails (2), re-sync, call 3
    # fails (3): the step stops there, before a third failure is reported to the pool.
    pool = FakePool([StandIn(capacity=4, per_call=4, down_on=frozenset(range(1, 10)))])
    scheduler = RequestScheduler(pool)
    resyncs = []
    scheduler.resync = lambda: (resyncs.append(1), pool.weights_updated())
    with pytest.raises(EngineError, match=rf"3 request\(s\) \(#0 rid r0, #1 rid r1, #2 rid r2\) failed on "
                                          rf"{MAX_ATTEMPTS} engines; last: rollout engine 0 \(stand-in\) failed: "
                                          r"EngineUnavailableError: server of engine 0 died"):
        scheduler.generate(_requests(3), pool.limits)
    assert MAX_ATTEMPTS == 3 and len(pool.calls) == 3 and all(c.rids == _rids(0, 1, 2) for c in pool.calls)
    assert len(resyncs) == 2 and len(pool.failed) == 2
    assert dict(scheduler.fault_counts) == {"requests_retried": 6, "mid_rollout_resyncs": 2}


def test_with_no_engine_left_a_step_without_a_working_re_sync_fails_clearly():
    def dead_pool():
        return FakePool([StandIn(capacity=4, per_call=4, down_on=frozenset({1}))])

    pool = dead_pool()  # no hook
    with pytest.raises(EngineError, match=r"^no rollout engine is left to serve 3 request\(s\) \(#0 rid r0, #1 rid "
                                          r"r1, #2 rid r2\): engine 0 \(stand-in\): restarting$"):
        RequestScheduler(pool).generate(_requests(3), pool.limits)

    pool = dead_pool()
    scheduler = RequestScheduler(pool)
    scheduler.resync = lambda: (_ for _ in ()).throw(RuntimeError("weight push failed (stand-in)"))
    with pytest.raises(EngineError, match=r"re-syncing the restarted engines failed: RuntimeError: weight push "
                                          r"failed \(stand-in\)") as info:
        scheduler.generate(_requests(3), pool.limits)
    assert isinstance(info.value.__cause__, RuntimeError) and pool.events == ["engine 0 restarted"]

    pool = dead_pool()
    scheduler = RequestScheduler(pool)
    scheduler.resync = lambda: None  # forgets weights_updated()
    with pytest.raises(EngineError, match=r"no engine serves \(a re-sync hook must end with weights_updated\(\)\): "
                                          r"engine 0 \(stand-in\): waiting for the next sync"):
        scheduler.generate(_requests(3), pool.limits)
    assert "mid_rollout_resyncs" not in scheduler.fault_counts

    pool = dead_pool()
    pool.restart_error = EngineError("engine 0 could not be restarted (stand-in)")
    scheduler = RequestScheduler(pool)
    scheduler.resync = lambda: pytest.fail("no re-sync after a failed restart")
    with pytest.raises(EngineError, match=r"could not be restarted \(stand-in\)"):
        scheduler.generate(_requests(3), pool.limits)


@pytest.mark.parametrize("answers, message", [
    ("refuses", r"rollout engine 1 \(stand-in\) failed on 2 request\(s\) \(#2 rid r2, #3 rid r3\): ValueError: the "
                r"server refused r2 \(stand-in\)"),
    ("one short", r"rollout engine 1 \(stand-in\) returned 1 outputs for 2 requests \(#2 rid r2, #3 rid r3\)"),
    ("other rid", r"rollout engine 1 \(stand-in\) answered request 'r2' with the output of 'x'"),
])  # fmt: skip
def test_any_other_engine_error_stops_the_step_and_takes_no_engine_out(answers, message):
    pool = FakePool([StandIn(call_s=1.0), StandIn(call_s=0.5, answers=answers)])
    scheduler = RequestScheduler(pool)
    with pytest.raises(EngineError, match=message):
        scheduler.generate(_requests(8), pool.limits)
    assert pool.failed == [] and pool.states == [EngineState.SERVING] * 2 and not scheduler.fault_counts


def test_an_empty_step_sends_nothing():
    pool = FakePool([StandIn(), StandIn()])
    assert RequestScheduler(pool).generate([], pool.limits) == [] and pool.calls == []


def test_a_callback_adds_requests_and_a_stop_drops_the_queue_and_aborts_what_is_in_flight():
    """One engine, window 2, one request per call of 1 s.  t=0: r0, r1 sent.  t=1: r0 back -> the callback adds r4
    (queue r2 r3 r4), r2 is sent; r1 back (same time, sent before r2 ends) -> stop: r3 and r4 are dropped, engine 0
    (r2 in flight) is aborted; r2 is drained and handed to the callback with ``stopped`` set."""
    pool = FakePool([StandIn(capacity=2, per_call=1)])
    scheduler = RequestScheduler(pool, clock=lambda: pool.now)
    seen = []

    def on_outputs(step, indices, outputs, seconds):
        seen.append((indices, [o.rid for o in outputs], seconds, step.stopped))
        if indices == [0]:
            assert step.add(_requests(5)[4:]) == 4
        elif indices == [1]:
            step.stop()

    outputs = scheduler.generate(_requests(4), pool.limits, on_outputs)
    assert [o.rid if o is not None else None for o in outputs] == ["r0", "r1", "r2", None, None]
    assert seen == [([0], ["r0"], 1.0, False), ([1], ["r1"], 1.0, False), ([2], ["r2"], 1.0, True)]
    assert pool.sends() == [(0.0, 0, ["r0"]), (0.0, 0, ["r1"]), (1.0, 0, ["r2"])]
    assert pool.events == ["abort [0] at 1"]

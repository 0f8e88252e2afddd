"""The request scheduler of the rollout engines: one queue per step, a window per engine, retries.

:meth:`RequestScheduler.generate` completes one step's requests on the engines of an :class:`EnginePool`
and returns one output per request, in request order.  Every engine keeps at most its window of requests
in flight (:func:`balance_windows`) and gets the next queued ones whenever one of its calls returns, in
calls of at most its ``max_requests_per_call``; each round fills the serving engines least free first,
each with ``min(free window, ceil(queued / engines left))`` requests.

Faults: a call that raises :class:`EngineDown`, or an engine that the pool reports unhealthy after
``monitor_s`` seconds without any answer, takes that engine out (:meth:`EnginePool.fail`); its requests
in flight go back to the front of the queue.  Each request is answered exactly once (the results of an
abandoned call are never read) and sent at most ``max_attempts`` times.  When requests wait and no engine
serves, the scheduler waits for the restarts and calls the re-sync hook (:attr:`RequestScheduler.resync`),
which must leave an engine serving.  ``generate`` returns once no engine is being restarted.

Streaming (dynamic sampling): an ``on_outputs`` callback sees each call's outputs as they arrive and may
add requests to the step or stop it; a stopped step drops its queue, aborts the calls in flight
(:meth:`EnginePool.abort`) and returns once they are back, without waiting for them to finish generating.

No Ray here: the engine group of :mod:`slime.ray.engine_group` is one :class:`EnginePool`, the tests use
plain Python stand-ins.  Rationale: ``docs/design/engine_group.md``.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import time
from typing import Callable, Hashable, Protocol

from slime.rollout.engines.base import GenerateOutput, GenerateRequest

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Times one request is sent before its engines' failures stop the step."""
HEALTH_MONITOR_S = 10.0
"""Seconds without any answer after which the engines with requests in flight are asked for their health."""
ERROR_CHARS = 2000
"""Characters of an exception (the end of its traceback) quoted in an error message."""


class EngineError(RuntimeError):
    """A rollout engine failed while serving requests; the message names the engine and the requests."""


class EngineDown(Exception):
    """Raised by :meth:`EnginePool.result`: the engine that served the call is gone (its server or its
    actor died); its requests go to the other engines and the engine is restarted.

    Args:
        why: what happened, for the log and for the error that stops a request at its last attempt.
        cause: the exception the pool saw, handed back to :meth:`EnginePool.fail` (None: none).
    """

    def __init__(self, why: str, cause: BaseException | None = None):
        super().__init__(why)
        self.why, self.cause = why, cause


class EngineState(str, enum.Enum):
    """Where an engine is in its fault cycle; the value is how :meth:`RequestScheduler.generate` names it."""

    SERVING = "serving"
    RESTARTING = "restarting"
    RESTARTED = "waiting for the next sync"  # healthy again, serves after the next weight sync
    DOWN = "restart failed"


class EnginePool(Protocol):
    """The engines as the scheduler sees them; engines are numbered ``0 .. E-1``."""

    def state(self, engine: int) -> EngineState:
        """The engine's :class:`EngineState`; only ``SERVING`` engines get requests."""

    def describe(self, engine: int) -> str:
        """The engine's name for messages, e.g. ``"engine 0 (node 10.0.0.1, bundles [0])"``."""

    def submit(self, engine: int, requests: list[GenerateRequest]) -> Hashable:
        """Start one ``generate`` call of ``requests`` on ``engine``; returns a handle of the call."""

    def wait(self, calls: list[Hashable], timeout_s: float) -> Hashable | None:
        """Block until one of ``calls`` has finished and return it; ``None`` after ``timeout_s`` seconds."""

    def result(self, call: Hashable) -> list[GenerateOutput]:
        """The outputs of a finished call.  Raises :class:`EngineDown` for a gone engine; anything else it
        raises stops the step."""

    def unhealthy(self, engines: set[int], timeout_s: float) -> dict[int, str]:
        """Engines of ``engines`` whose health is False, raises, or does not answer in ``timeout_s`` -> why."""

    def fail(self, engine: int, why: str, cause: BaseException | None) -> None:
        """Take ``engine`` out of service and start its restart (its state leaves ``SERVING``)."""

    def wait_for_restarts(self) -> None:
        """Block until no engine is ``RESTARTING``; raises :class:`EngineError` when a restart fails."""

    def abort(self, engines: set[int]) -> None:
        """Make the calls in flight at ``engines`` return now: what an engine cut off comes back with
        ``finish_reason "abort"``; an engine that cannot abort finishes its calls (only a stopped step asks)."""


OutputsCallback = Callable[["Step", list[int], list[GenerateOutput], float], None]
"""``on_outputs(step, indices, outputs, seconds)``: one finished call's request indices (into the step's requests,
which :meth:`Step.add` extends), their outputs, and the call's seconds from send to read; it may call
``step.add(requests)`` or ``step.stop()``."""


class RequestScheduler:
    """Completes each step's requests on the serving engines of ``pool`` (see the module docstring).

    Args:
        pool: the engines.
        fault_counts: incremented here: ``requests_retried`` (requests sent again after their engine went
            down) and ``mid_rollout_resyncs``; the pool counts the rest.  Default: a new counter.
        max_attempts: sends of one request before its engines' failures stop the step.
        monitor_s: seconds without an answer after which the engines with requests in flight are checked.
        clock: seconds, for the calls' durations handed to ``on_outputs``.
    """

    def __init__(self, pool: EnginePool, fault_counts: collections.Counter | None = None, *,
                 max_attempts: int = MAX_ATTEMPTS, monitor_s: float = HEALTH_MONITOR_S,
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.clock = pool, clock
        self.fault_counts = fault_counts if fault_counts is not None else collections.Counter()
        self.max_attempts, self.monitor_s = max_attempts, monitor_s
        self.resync: Callable[[], None] | None = None
        """Called with no arguments when requests wait, no engine serves and some engine is being restarted or
        waits for the weights, once the restarts are done; it must leave an engine ``SERVING``.  None: such a
        step fails."""

    def generate(self, requests: list[GenerateRequest], limits: list[tuple[int, int]],
                 on_outputs: OutputsCallback | None = None) -> list[GenerateOutput | None]:
        """Complete ``requests``.

        Args:
            requests: the step's requests.
            limits: per engine, ``(capacity, max_requests_per_call)``, ints >= 1.
            on_outputs: called after each call's outputs are read (:data:`OutputsCallback`), also for the calls
                drained after a stop (``step.stopped``).

        Returns:
            One output per request (with those added by ``on_outputs``), in request order; ``engine_index``
            says which engine served it.  None only after a stop: for a request never sent, or whose engine
            went down after the stop (it is not sent again).

        Raises:
            EngineError: a call raised another error than :class:`EngineDown`, returned a wrong number of
                outputs or another request's output; a request failed ``max_attempts`` times; no engine is
                left to serve and none could be re-synced; a restart failed; the re-sync hook raised or left
                no engine serving.  The message names the engine and the first requests concerned.
        """
        step = Step(self, requests, limits, on_outputs)
        step.run()
        self.pool.wait_for_restarts()
        return step.outputs


class Step:
    """One :meth:`RequestScheduler.generate` call: its queue, windows, calls in flight and outputs; an ``on_outputs``
    callback gets it to :meth:`add` requests or :meth:`stop`."""

    def __init__(self, scheduler: RequestScheduler, requests: list[GenerateRequest], limits: list[tuple[int, int]],
                 on_outputs: OutputsCallback | None = None):
        self.scheduler, self.pool, self.requests = scheduler, scheduler.pool, list(requests)
        self.on_outputs, self.stopped = on_outputs, False
        self.per_call = [per_call for _, per_call in limits]
        self.windows = balance_windows(len(requests), [capacity for capacity, _ in limits])
        self.outputs: list[GenerateOutput | None] = [None] * len(requests)
        self.attempts = [0] * len(requests)
        self.queue = collections.deque(range(len(requests)))
        self.in_flight = [0] * len(limits)  # requests sent to each engine and not yet back
        self.running: dict[Hashable, tuple[int, list[int]]] = {}  # call -> (engine, request indices)
        self.sent_at: dict[Hashable, float] = {}

    def add(self, requests: list[GenerateRequest]) -> int:
        """Queue more requests in this step (after those queued); returns the index of the first one."""
        first = len(self.requests)
        self.requests.extend(requests)
        self.outputs.extend([None] * len(requests))
        self.attempts.extend([0] * len(requests))
        self.queue.extend(range(first, len(self.requests)))
        return first

    def stop(self) -> None:
        """Send nothing more, abort the calls in flight and return once they are back (their outputs kept)."""
        if self.stopped:
            return
        self.stopped = True
        self.queue.clear()
        busy = {engine for engine, _ in self.running.values()}
        if busy:
            self.pool.abort(busy)

    def run(self) -> None:
        while self.queue or self.running:
            self._fill()
            if not self.running:  # requests queued, and no engine serves
                self._resync_mid_rollout()
                continue
            call = self.pool.wait(list(self.running), self.scheduler.monitor_s)
            if call is None:
                busy = {engine for engine, _ in self.running.values()}
                for engine, why in self.pool.unhealthy(busy, self.scheduler.monitor_s).items():
                    self._fail(engine, why, None)
                continue
            self._collect(call)

    def _fill(self) -> None:
        """Hand queued requests to the serving engines with free room, least free first (water-filling)."""
        serving = [e for e in range(len(self.windows)) if self.pool.state(e) is EngineState.SERVING]
        free = [(room, e) for room, e in sorted((self.windows[e] - self.in_flight[e], e) for e in serving) if room > 0]
        for k, (room, engine) in enumerate(free):
            share = min(room, math.ceil(len(self.queue) / (len(free) - k)))
            while share > 0:
                batch = [self.queue.popleft() for _ in range(min(share, self.per_call[engine]))]
                call = self.pool.submit(engine, [self.requests[i] for i in batch])
                self.running[call] = (engine, batch)
                self.sent_at[call] = self.scheduler.clock()
                self.in_flight[engine] += len(batch)
                share -= len(batch)

    def _collect(self, call: Hashable) -> None:
        """Read a finished call: its outputs, or its engine's failure."""
        engine, batch = self.running.pop(call)
        seconds = self.scheduler.clock() - self.sent_at.pop(call)
        self.in_flight[engine] -= len(batch)
        what = f"rollout {self.pool.describe(engine)}"
        try:
            results = self.pool.result(call)
        except EngineDown as down:
            self._requeue(engine, batch, f"failed: {down.why}")
            self._fail(engine, down.why, down.cause)
            return
        except Exception as e:
            raise EngineError(f"{what} failed on {len(batch)} request(s) ({self._rids(batch)}): {error_tail(e)}") from e
        if len(results) != len(batch):
            raise EngineError(f"{what} returned {len(results)} outputs for {len(batch)} requests "
                              f"({self._rids(batch)}); an engine returns one output per request")
        for i, out in zip(batch, results):
            if out.rid is not None and self.requests[i].rid is not None and out.rid != self.requests[i].rid:
                raise EngineError(f"{what} answered request {self.requests[i].rid!r} with the output of {out.rid!r}")
            out.engine_index = engine
            self.outputs[i] = out
        if self.on_outputs is not None:
            self.on_outputs(self, batch, results, seconds)

    def _requeue(self, engine: int, batch: list[int], why: str) -> None:
        """Put ``batch`` back at the front of the queue, one more attempt each (after a stop: drop it)."""
        if self.stopped:
            return
        for i in batch:
            self.attempts[i] += 1
        exhausted = [i for i in batch if self.attempts[i] >= self.scheduler.max_attempts]
        if exhausted:
            raise EngineError(f"{len(exhausted)} request(s) ({self._rids(exhausted)}) failed on "
                              f"{self.scheduler.max_attempts} engines; last: rollout {self.pool.describe(engine)} "
                              f"{why}")
        self.queue.extendleft(reversed(batch))
        self.scheduler.fault_counts["requests_retried"] += len(batch)

    def _fail(self, engine: int, why: str, cause: BaseException | None) -> None:
        """Take ``engine`` out: requeue everything it holds, then the pool restarts it."""
        for call in [c for c, (e, _) in self.running.items() if e == engine]:
            self.sent_at.pop(call)
            self._requeue(engine, self.running.pop(call)[1], why)
        self.in_flight[engine] = 0
        self.pool.fail(engine, why, cause)

    def _resync_mid_rollout(self) -> None:
        """No engine serves and requests wait: wait for the restarts, then run the re-sync hook.

        Raises:
            EngineError: no hook, or no engine restarting or waiting for the weights; a restart failed; the
                hook raised, or left no engine serving.
        """
        pool, engines = self.pool, range(len(self.windows))
        queued = list(self.queue)
        left = f"no rollout engine is left to serve {len(queued)} request(s) ({self._rids(queued)})"
        recovering = any(pool.state(e) in (EngineState.RESTARTING, EngineState.RESTARTED) for e in engines)
        if self.scheduler.resync is None or not recovering:
            raise EngineError(f"{left}: {self._fault_summary()}")
        logger.warning("%s (%s): re-syncing the restarted engines with the current weights mid-rollout", left,
                       self._fault_summary())
        pool.wait_for_restarts()
        try:
            self.scheduler.resync()
        except Exception as e:
            raise EngineError(f"{left}, and re-syncing the restarted engines failed: {error_tail(e)}") from e
        if not any(pool.state(e) is EngineState.SERVING for e in engines):
            raise EngineError(f"{left}: the mid-rollout re-sync returned, but no engine serves (a re-sync hook "
                              f"must end with weights_updated()): {self._fault_summary()}")
        self.scheduler.fault_counts["mid_rollout_resyncs"] += 1
        logger.info("rollout engines re-synced mid-rollout; %d request(s) go on", len(queued))

    def _fault_summary(self) -> str:
        states = [(e, self.pool.state(e)) for e in range(len(self.windows))]
        out = [f"{self.pool.describe(e)}: {state.value}" for e, state in states if state is not EngineState.SERVING]
        return "; ".join(out) or "none failed"

    def _rids(self, batch: list[int], shown: int = 3) -> str:
        names = [f"#{i}" + (f" rid {self.requests[i].rid}" if self.requests[i].rid is not None else "")
                 for i in batch[:shown]]
        return ", ".join(names) + (f", ... ({len(batch)} in all)" if len(batch) > shown else "")


def balance_windows(num_requests: int, capacities: list[int]) -> list[int]:
    """The most requests :meth:`RequestScheduler.generate` keeps in flight at each engine in a step of
    ``num_requests`` requests (``docs/design/engine_group.md`` says why half an even share).

    Args:
        num_requests: requests in the step (>= 0).
        capacities: each engine's :attr:`RolloutEngine.capacity` (ints >= 1).

    Returns:
        Per engine: ``capacities[0]`` for one engine; else
        ``min(capacity, max(1, ceil(ceil(num_requests / E) / 2)))`` for ``E`` engines.
    """
    if len(capacities) == 1:
        return list(capacities)
    even_share = math.ceil(num_requests / len(capacities))
    window = max(1, math.ceil(even_share / 2))
    return [min(capacity, window) for capacity in capacities]


def error_tail(error: BaseException, chars: int = ERROR_CHARS) -> str:
    """The end of an exception's text (a Ray error carries the remote traceback, whose end matters)."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= chars else "..." + text[-chars:]

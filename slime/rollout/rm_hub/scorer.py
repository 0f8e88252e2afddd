"""Batched reward scoring in worker processes, with a time limit per response.

Why processes: a SymPy comparison can run for ever (``\\boxed{9^{9^{9^{9^{9}}}}}``), and
the only way to interrupt pure-Python code is a signal, which Python delivers to the main
thread of a process.  math-verify's own timeout is ``signal.alarm`` for that reason, and
fails in a thread; the rollout manager runs in a driver that may host Ray and event-loop
threads.  So every reward call runs in the main thread of a worker process.

Each response gets two limits:

1. soft, ``--rm-timeout`` seconds: the worker arms ``signal.setitimer(ITIMER_REAL)`` around
   the whole reward call (label parse, answer parse, comparison, ``evalf``).  The handler
   raises :class:`RewardTimeout`, a ``BaseException`` so that the ``except Exception``
   handlers of math-verify and SymPy do not swallow it.  The response scores 0.0 and is
   counted in :attr:`RewardStats.timeouts`.  This replaces math-verify's timeout, which is
   disabled in :mod:`.answer`: it takes whole seconds only, is armed separately for each
   parse and comparison, and turns a timeout into a silent ``False``, so it could not be
   counted.
2. hard, ``2 * --rm-timeout + 1`` seconds: a signal handler runs only between Python
   bytecodes, so one long C call (a huge integer power) outlives the soft limit.  When a
   result is that late, the worker process is killed (``SIGKILL``) and restarted; the
   response scores 0.0 and is counted in :attr:`RewardStats.killed`.

A worker that dies by itself (a crash, the OOM killer) costs its response a 0.0, counted
in :attr:`RewardStats.worker_deaths`, and is restarted.  A reward function that raises or
returns something that is not a finite number gives 0.0, counted in
:attr:`RewardStats.errors`.  Every ``score`` call that has such responses logs one warning
with their count and the first few (index, cause, label, end of the response).

The pool: ``--rm-num-workers`` single-process ``ProcessPoolExecutor``\\ s (``spawn``
context, so no fork of a driver that holds Ray / CUDA state), each given one response at a
time, so the scorer always knows which response a stuck or dead worker was on.  Workers
start on the first ``score`` call and are reused by the next ones; :meth:`RewardScorer.close`
(or the ``with`` block) stops them.  As with any ``spawn`` pool, the driver script must
keep its entry point under ``if __name__ == "__main__":``, because each worker imports the
main module.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import math
import multiprocessing
import numbers
import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

from slime.rollout.rm_hub.config import resolve_reward_function

if TYPE_CHECKING:
    from slime.rollout.rm_hub.config import RewardConfig

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""Seconds a new worker may take to start (a spawned interpreter importing SymPy on a loaded machine)."""
_LOGGED_FAILURES = 5
"""Failed responses described in a ``score`` call's warning."""
_LOGGED_CHARS = 200
"""Characters of a failed response (and of an error message) shown in the warning."""


def hard_deadline_s(rm_timeout: float) -> float:
    """Seconds after which a response without a result gets its worker killed: ``2 * rm_timeout + 1``.

    Twice the soft limit plus a second leaves room for SymPy to unwind after the timer
    fires and for process scheduling on a loaded machine.
    """
    return 2 * rm_timeout + 1.0


@dataclasses.dataclass
class RewardStats:
    """Counts of scored responses, by outcome; every field is a number of responses.

    A failed response (any counter but ``responses``) scored 0.0.  ``dataclasses.asdict``
    gives the metrics dict.
    """

    responses: int = 0
    """Responses scored, whatever the outcome."""
    timeouts: int = 0
    """Reward calls interrupted by ``--rm-timeout``."""
    errors: int = 0
    """Reward calls that raised, or returned something other than a finite number."""
    killed: int = 0
    """Responses whose worker was killed at the hard deadline (stuck in a C call)."""
    worker_deaths: int = 0
    """Responses whose worker process died while scoring them."""

    @property
    def failed(self) -> int:
        """Responses that scored 0.0 because of a timeout, an error, a kill or a worker death."""
        return self.timeouts + self.errors + self.killed + self.worker_deaths


class _Outcome(enum.Enum):
    """How one reward call ended; the value of a failure is its :class:`RewardStats` field."""

    OK = "ok"
    TIMEOUT = "timeouts"
    ERROR = "errors"
    KILLED = "killed"
    WORKER_DIED = "worker_deaths"


# ----------------------------------------------------------------------------- worker side


class RewardTimeout(BaseException):
    """Raised in a worker by the ``--rm-timeout`` timer (a ``BaseException``, see the module docstring)."""


def _raise_timeout(signum, frame):
    raise RewardTimeout


def _init_worker() -> None:
    """Runs once in each worker: Ctrl-C is the driver's business; SIGALRM raises :class:`RewardTimeout`.

    math-verify warns once per process that its timeout is disabled; here the timer of
    :func:`_score_in_worker` replaces it, so its loggers are set to ERROR in workers.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _raise_timeout)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Warm math-verify's lazily built parsers (a fraction of a second, several on a busy
    # machine) before the worker counts as started, so that a fresh worker's first response
    # is not charged for them against the hard deadline.
    from slime.rollout.rm_hub.config import RewardConfig
    from slime.rollout.rm_hub.math_reward import math_reward

    math_reward("\\boxed{\\frac{1}{2}}", "0.5", RewardConfig())


def _score_in_worker(response: str, label: str, cfg: RewardConfig) -> tuple[float, _Outcome, str]:
    """Score one response in a worker's main thread, under the ``cfg.rm_timeout`` timer.

    Returns:
        ``(reward, outcome, detail)``; ``reward`` is 0.0 unless ``outcome`` is OK, and
        ``detail`` says what went wrong (empty when OK).
    """
    reward_function = resolve_reward_function(cfg)
    signal.setitimer(signal.ITIMER_REAL, cfg.rm_timeout)
    try:
        try:
            reward = reward_function(response, label, cfg)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except RewardTimeout:
        return 0.0, _Outcome.TIMEOUT, f"no result within --rm-timeout {cfg.rm_timeout} s"
    except Exception as error:
        return 0.0, _Outcome.ERROR, f"{type(error).__name__}: {str(error)[:_LOGGED_CHARS]}"
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        return 0.0, _Outcome.ERROR, f"the reward function returned {reward!r:.{_LOGGED_CHARS}}, not a finite float"
    return float(reward), _Outcome.OK, ""


# ----------------------------------------------------------------------------- driver side


class _Worker:
    """One worker process, in its own single-process executor so that it can be killed alone."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=context, initializer=_init_worker
        )
        self._pid = self.executor.submit(os.getpid)

    def wait_started(self) -> None:
        """Block until the process has started and run its initializer.

        Raises:
            RuntimeError: it did not start within :data:`WORKER_START_TIMEOUT_S`, or died.
        """
        try:
            self._pid.result(timeout=WORKER_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(
                f"a reward worker process did not start within {WORKER_START_TIMEOUT_S:.0f} s; "
                f"check that 'python -c \"import slime.rollout.rm_hub.scorer\"' is quick in this environment"
            ) from None
        except BrokenProcessPool as error:
            raise RuntimeError(
                "a reward worker process exited while starting (its traceback is on stderr above); workers "
                "are spawned, so they import the main module: run the driver from a file or with -m, and keep "
                "its entry point under 'if __name__ == \"__main__\":'"
            ) from error

    def kill(self) -> None:
        """SIGKILL the process and release the executor (without waiting for a process that never started)."""
        if not (self._pid.done() and self._pid.exception() is None):
            self.executor.shutdown(wait=False, cancel_futures=True)
            return
        try:
            os.kill(self._pid.result(), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had already exited
        self.executor.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Let the idle process exit and wait for it."""
        self.executor.shutdown(wait=True, cancel_futures=True)


class RewardScorer:
    """Scores batches of responses with the reward function of a :class:`RewardConfig`, in worker processes.

    Use as a context manager, or call :meth:`close`; the ``--rm-num-workers`` processes start
    on the first :meth:`score` call and are reused.  See the module docstring for the time
    limits and what happens to a response that hits one.

    Args:
        cfg: the reward flags; ``rm_num_workers`` sizes the pool.

    Raises:
        ConfigError: the reward function of ``cfg`` cannot be imported or has the wrong
            signature (checked here, before any worker starts).

    Attributes:
        cfg: the config passed in.
        stats: :class:`RewardStats` since creation or the last :meth:`reset_stats`.
    """

    def __init__(self, cfg: RewardConfig):
        resolve_reward_function(cfg)
        self.cfg = cfg
        self.stats = RewardStats()
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * cfg.rm_num_workers
        self._closed = False

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def reset_stats(self) -> RewardStats:
        """Return the counts so far and start new ones (e.g. once per rollout step)."""
        stats, self.stats = self.stats, RewardStats()
        return stats

    def score(self, responses: list[str], labels: list[str]) -> list[float]:
        """Reward of each response against the label at the same index, with the scorer's reward flags.

        Args:
            responses: generated texts, length N.
            labels: gold answers, length N.

        Returns:
            N floats, in input order (0.0 / 1.0 for the built-in rewards); a response that
            timed out, errored, was killed or lost its worker scores 0.0 and is counted in
            :attr:`stats`.

        Raises:
            ValueError: ``responses`` and ``labels`` differ in length.
            TypeError: an element is not a ``str``; the message gives its index.
            RuntimeError: the scorer is closed, or a worker process cannot start.
        """
        if self._closed:
            raise RuntimeError("RewardScorer.score() called after close()")
        if len(responses) != len(labels):
            raise ValueError(f"got {len(responses)} responses but {len(labels)} labels; pass one label per response")
        for name, texts in (("responses", responses), ("labels", labels)):
            for index, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"{name}[{index}] is a {type(text).__name__}, expected str: {text!r:.80}")
        cfg = self.cfg
        self._start_idle_workers()
        rewards = [0.0] * len(responses)
        failures: list[tuple[int, _Outcome, str]] = []
        queue = collections.deque(range(len(responses)))
        idle = list(range(len(self._workers)))
        running: dict[concurrent.futures.Future, tuple[int, int, float]] = {}  # -> (worker, response, deadline)
        try:
            while queue or running:
                while queue and idle:
                    worker, index = idle.pop(), queue.popleft()
                    future = self._submit(worker, responses[index], labels[index], cfg)
                    running[future] = (worker, index, time.monotonic() + hard_deadline_s(cfg.rm_timeout))
                next_deadline = min(deadline for _, _, deadline in running.values())
                timeout = max(0.0, next_deadline - time.monotonic())
                done, _ = concurrent.futures.wait(running, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    worker, index, _ = running.pop(future)
                    try:
                        reward, outcome, detail = future.result()
                    except BrokenProcessPool:
                        reward, outcome, detail = 0.0, _Outcome.WORKER_DIED, "the worker process died"
                        self._restart(worker, kill=False)
                    self._record(index, reward, outcome, detail, rewards, failures)
                    idle.append(worker)
                now = time.monotonic()
                for future, (worker, index, deadline) in list(running.items()):
                    if now >= deadline:
                        del running[future]
                        self._restart(worker, kill=True)
                        detail = f"no result within the hard deadline {hard_deadline_s(cfg.rm_timeout):g} s"
                        self._record(index, 0.0, _Outcome.KILLED, detail, rewards, failures)
                        idle.append(worker)
        except BaseException:
            # Interrupted (e.g. Ctrl-C): do not leave busy workers behind.
            for worker, _, _ in running.values():
                if self._workers[worker] is not None:
                    self._workers[worker].kill()
                    self._workers[worker] = None
            raise
        if failures:
            self._log_failures(failures, len(responses), responses, labels)
        return rewards

    def close(self) -> None:
        """Stop the worker processes (idempotent).  :meth:`score` raises afterwards."""
        self._closed = True
        for index, worker in enumerate(self._workers):
            if worker is not None:
                worker.close()
                self._workers[index] = None

    # --------------------------------------------------------------------- internals

    def _start_idle_workers(self) -> None:
        """Start every missing worker, in parallel, and wait until all are ready (none is kept if one fails)."""
        missing = [i for i, worker in enumerate(self._workers) if worker is None]
        for i in missing:
            self._workers[i] = _Worker(self._context)
        try:
            for i in missing:
                self._workers[i].wait_started()
        except BaseException:
            for i in missing:
                self._workers[i].kill()
                self._workers[i] = None
            raise

    def _restart(self, worker: int, kill: bool) -> None:
        """Replace worker ``worker`` with a fresh process (killing the old one first when ``kill``)."""
        if kill:
            self._workers[worker].kill()
        else:
            self._workers[worker].close()
        self._workers[worker] = None
        self._start_idle_workers()

    def _submit(self, worker: int, response: str, label: str, cfg: RewardConfig) -> concurrent.futures.Future:
        """Hand one response to a worker, restarting it first if it died while idle."""
        try:
            return self._workers[worker].executor.submit(_score_in_worker, response, label, cfg)
        except BrokenProcessPool:
            logger.warning("reward worker %d had died while idle; restarting it", worker)
            self._restart(worker, kill=False)
            return self._workers[worker].executor.submit(_score_in_worker, response, label, cfg)

    def _record(self, index, reward, outcome, detail, rewards, failures) -> None:
        rewards[index] = reward
        self.stats.responses += 1
        if outcome is _Outcome.OK:
            return
        setattr(self.stats, outcome.value, getattr(self.stats, outcome.value) + 1)
        failures.append((index, outcome, detail))

    @staticmethod
    def _log_failures(failures, total, responses, labels) -> None:
        counts = collections.Counter(outcome.value for _, outcome, _ in failures)
        examples = "; ".join(
            f"#{index} {outcome.value} ({detail}) label={labels[index]!r} "
            f"response ending {responses[index][-_LOGGED_CHARS:]!r}"
            for index, outcome, detail in failures[:_LOGGED_FAILURES]
        )
        logger.warning(
            "%d of %d responses scored 0.0 without a verdict (%s); first: %s",
            len(failures),
            total,
            ", ".join(f"{n} {name}" for name, n in sorted(counts.items())),
            examples,
        )

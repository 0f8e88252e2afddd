"""Batched reward scoring in worker processes, with a time limit per response.

Every reward call runs in the main thread of a worker process (``--rm-num-workers`` single-process
executors, one response each at a time, forked from a ``forkserver`` that has math-verify imported:
:func:`worker_context`), under a soft limit, ``--rm-timeout`` (a
``SIGALRM`` timer raising :class:`RewardTimeout`), and a hard one, :func:`hard_deadline_s`, after
which the worker is killed and restarted.  A response that times out, errors, is killed or loses its
worker scores 0.0 and is counted in :class:`RewardStats`; a NaN or infinite reward is returned as it is (and
counted), so that the rollout drops its group rather than train on a made-up 0.0.  Why processes and two limits:
``docs/design/rewards.md``.  As with any ``spawn`` or ``forkserver`` pool, each worker imports the driver's main
module, so its entry point must be under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

from slime.rollout.rm_hub.config import resolve_reward_function
from slime.utils.forkserver import forkserver_context

if TYPE_CHECKING:
    from slime.rollout.rm_hub.config import RewardConfig, RewardFunction

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""Seconds a new worker may take to start (the first one starts the fork server, which imports SymPy; on a loaded
machine that takes seconds)."""
PRELOADED_MODULES = ("math_verify",)
"""Imported once by the fork server (:func:`worker_context`), so that a worker forked from it starts with them:
math-verify and what it imports (SymPy, latex2sympy2), most of a worker's start-up.  Third-party modules only: the
server imports with its own ``sys.path`` (the standard library does not pass the driver's), so a slime module
preloaded there could be another checkout's copy than the driver's."""
_LOGGED_FAILURES = 5
"""Failed responses described in a ``score`` call's warning."""
_LOGGED_CHARS = 200
"""Characters of a failed response (and of an error message) shown in the warning."""


def hard_deadline_s(rm_timeout: float) -> float:
    """Seconds after which a response without a result gets its worker killed: ``2 * rm_timeout + 1``."""
    return 2 * rm_timeout + 1.0


@dataclasses.dataclass
class RewardStats:
    """Counts of scored responses by outcome (each field a number of responses); a failure scored 0.0, a
    non-finite reward kept as it is."""

    responses: int = 0
    """Responses scored, whatever the outcome."""
    timeouts: int = 0
    """Reward calls interrupted by ``--rm-timeout``."""
    errors: int = 0
    """Reward calls that raised, or returned something other than a real number (a str, a bool, None, ...)."""
    non_finite: int = 0
    """Reward calls that returned NaN or +-inf: returned as is, not a failure; the rollout drops their groups
    (``rollout/non_finite_reward_groups``)."""
    killed: int = 0
    """Responses whose worker was killed at the hard deadline (stuck in a C call)."""
    worker_deaths: int = 0
    """Responses whose worker process died while scoring them."""

    @property
    def failed(self) -> int:
        """Responses scored 0.0 for a timeout, an error, a kill or a worker death."""
        return self.timeouts + self.errors + self.killed + self.worker_deaths


class _Outcome(enum.Enum):
    OK = "ok"
    TIMEOUT = "timeouts"
    ERROR = "errors"
    KILLED = "killed"
    WORKER_DIED = "worker_deaths"
    NON_FINITE = "non_finite"


# ----------------------------------------------------------------------------- worker side


class RewardTimeout(BaseException):
    """Raised in a worker by the ``--rm-timeout`` timer; a ``BaseException``, so that SymPy cannot swallow it."""


def _raise_timeout(signum, frame):
    raise RewardTimeout


def _exit_with_parent() -> None:
    """Exit this worker as soon as the process that started it dies.

    A worker forked from the fork server is not the driver's child: when the driver is killed (SIGKILL, or a Ray
    actor that Ray stops, which kills only its direct children), an idle worker would wait on its call queue for
    ever.  A daemon thread (SIGALRM blocked there, so that the ``--rm-timeout`` timer is handled by the main thread)
    waits on the parent's sentinel (:func:`multiprocessing.parent_process`) and leaves with ``os._exit``.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_reward_function: RewardFunction | None = None
"""This worker process's reward function, resolved once by :func:`_init_worker`."""


def _init_worker(cfg: RewardConfig, environ: dict[str, str]) -> None:
    """Take the driver's environment (a worker forked from the fork server has the server's, from its start), exit
    when the driver does, resolve ``cfg``'s reward function once for this worker, ignore SIGINT, raise
    :class:`RewardTimeout` on SIGALRM, quiet math-verify, warm its parsers."""
    global _reward_function
    os.environ.clear()
    os.environ.update(environ)
    _exit_with_parent()
    _reward_function = resolve_reward_function(cfg)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # in case the server's starter had it blocked
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Warm math-verify's lazily built parsers (a fraction of a second, several on a busy
    # machine) before the worker counts as started, so that a fresh worker's first response
    # is not charged for them against the hard deadline.
    from slime.rollout.rm_hub.math_reward import math_reward

    math_reward("\\boxed{\\frac{1}{2}}", "0.5", cfg)


def _score_in_worker(response: str, label: str, cfg: RewardConfig) -> tuple[float, _Outcome, str]:
    """``(reward, outcome, detail)`` of one response under the ``cfg.rm_timeout`` timer; reward 0.0 unless OK or
    NON_FINITE (a NaN or infinite float, passed on so that its group is dropped, not trained on as 0.0)."""
    signal.setitimer(signal.ITIMER_REAL, cfg.rm_timeout)
    try:
        try:
            reward = _reward_function(response, label, cfg)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except RewardTimeout:
        return 0.0, _Outcome.TIMEOUT, f"no result within --rm-timeout {cfg.rm_timeout} s"
    except Exception as error:
        return 0.0, _Outcome.ERROR, f"{type(error).__name__}: {str(error)[:_LOGGED_CHARS]}"
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return 0.0, _Outcome.ERROR, f"the reward function returned {reward!r:.{_LOGGED_CHARS}}, not a float"
    try:
        value = float(reward)
    except (OverflowError, ValueError, TypeError):  # an int past the float range (e.g. 1000!)
        detail = f"the reward function returned a number past the float range ({type(reward).__name__})"
        return 0.0, _Outcome.ERROR, detail
    if not math.isfinite(value):
        return value, _Outcome.NON_FINITE, f"the reward function returned {value}"
    return value, _Outcome.OK, ""


# ----------------------------------------------------------------------------- driver side


def worker_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` start method, its server preloaded with :data:`PRELOADED_MODULES`.

    A ``spawn`` worker starts a fresh interpreter that imports SymPy and math-verify (about 1 s of CPU) and tears
    them down on exit (about 0.6 s); a worker forked from the fork server has them already: 0.2-0.5 s to start and
    0.02 s to stop, measured on a 2-core machine (``docs/CONTRIBUTING.md``).  The server is started by the first
    worker of this process (a clean, single-threaded interpreter: forking it is safe where forking a threaded Ray
    actor is not); it lives while this process or one of its workers does, and each worker exits when this process
    does (:func:`_exit_with_parent`).  Workers get this process's environment at start (:func:`_init_worker`).
    The preload applies to the process's one fork server; if something else started it first, workers import the
    modules themselves (:mod:`slime.utils.forkserver`).
    """
    return forkserver_context(PRELOADED_MODULES)


class _Worker:
    """One worker process, in its own single-process executor so that it can be killed alone."""

    def __init__(self, context: multiprocessing.context.BaseContext, cfg: RewardConfig):
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=context, initializer=_init_worker, initargs=(cfg, dict(os.environ))
        )
        self._pid = self.executor.submit(os.getpid)
        self._pidfd: int | None = None  # the process itself, not its number: a later process may reuse the number
        self._pid.add_done_callback(self._open_pidfd)

    def _open_pidfd(self, pid: concurrent.futures.Future) -> None:
        """Hold a pidfd of the worker from the moment it reports its pid (alive then), where Linux has them."""
        if pid.exception() is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid.result())
            except OSError:  # already gone, or no pidfd support (kernel before 5.3): kill by number
                self._pidfd = None

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
                "import the main module as spawned processes do: run the driver from a file or with -m, and keep "
                "its entry point under 'if __name__ == \"__main__\":'"
            ) from error

    def kill(self) -> None:
        """SIGKILL the worker (through its pidfd where held: a worker that already exited is never confused with a
        later process given its number), then shut its executor down."""
        if not (self._pid.done() and self._pid.exception() is None):
            self.executor.shutdown(wait=False, cancel_futures=True)
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self._pid.result(), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had already exited
        self.executor.shutdown(wait=True, cancel_futures=True)
        self._close_pidfd()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class RewardScorer:
    """Scores batches of responses with the reward function of a :class:`RewardConfig`, in worker processes.

    A context manager (or call :meth:`close`); workers start on the first :meth:`score` and are reused.  It keeps
    no counts: each :meth:`score` adds its outcomes to the caller's :class:`RewardStats` (a rollout step's, an
    evaluation's).

    Raises:
        ConfigError: the reward function cannot be imported or has the wrong signature (before any worker starts).
    """

    def __init__(self, cfg: RewardConfig):
        resolve_reward_function(cfg)
        self.cfg = cfg
        self._context = worker_context()
        self._workers: list[_Worker | None] = [None] * cfg.rm_num_workers
        self._closed = False

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def score(self, responses: list[str], labels: list[str], stats: RewardStats | None = None) -> list[float]:
        """Reward of each response against the label at the same index: N floats in input order; each response's
        outcome is added to ``stats`` (None: not counted).

        A response that timed out, errored, was killed or lost its worker scores 0.0 and is counted in ``stats``
        (one warning per call names the first few).  A NaN or infinite reward is returned as it is and counted
        (``stats.non_finite``), without a warning here: the caller drops its group and says so.

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
        cfg, stats = self.cfg, RewardStats() if stats is None else stats
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
                    self._record(index, reward, outcome, detail, rewards, failures, stats)
                    idle.append(worker)
                now = time.monotonic()
                for future, (worker, index, deadline) in list(running.items()):
                    if now >= deadline:
                        del running[future]
                        self._restart(worker, kill=True)
                        detail = f"no result within the hard deadline {hard_deadline_s(cfg.rm_timeout):g} s"
                        self._record(index, 0.0, _Outcome.KILLED, detail, rewards, failures, stats)
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
        """Stop the worker processes (idempotent); :meth:`score` raises afterwards."""
        self._closed = True
        for index, worker in enumerate(self._workers):
            if worker is not None:
                worker.close()
                self._workers[index] = None

    # --------------------------------------------------------------------- internals

    def _start_idle_workers(self) -> None:
        """Start every missing worker in parallel and wait for all (none is kept if one fails)."""
        missing = [i for i, worker in enumerate(self._workers) if worker is None]
        for i in missing:
            self._workers[i] = _Worker(self._context, self.cfg)
        try:
            for i in missing:
                self._workers[i].wait_started()
        except BaseException:
            for i in missing:
                self._workers[i].kill()
                self._workers[i] = None
            raise

    def _restart(self, worker: int, kill: bool) -> None:
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

    @staticmethod
    def _record(index, reward, outcome, detail, rewards, failures, stats: RewardStats) -> None:
        rewards[index] = reward
        stats.responses += 1
        if outcome is _Outcome.OK:
            return
        setattr(stats, outcome.value, getattr(stats, outcome.value) + 1)
        if outcome is not _Outcome.NON_FINITE:  # logged where its group is dropped
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

"""Wall-time of the phases of one rollout step, for the ``perf/<phase>_time_s`` metrics.

The driver wraps each phase and logs the collected times with the step's other metrics::

    perf = {}
    with timed("rollout", perf):
        batch = rollout_manager.generate(rollout_id)
    with timed("train", perf):
        metrics = trainers.train(rollout_id, batch)
    logger.log(rollout_id, {**metrics, **perf})   # perf/rollout_time_s, perf/train_time_s

The clock is :func:`time.perf_counter` (monotonic, so wall-clock adjustments such as NTP
steps never give negative or inflated times).  Work launched asynchronously on a GPU is
only counted once the phase waits for it, as the driver's phases do (they return results).
"""

from __future__ import annotations

import time
from typing import Any


class Timer:
    """Context manager that measures the wall time of one phase, in seconds.

    On exit (also when the block raises) the elapsed time is stored in ``elapsed_s`` and, if
    ``store`` is given, added to ``store["perf/<phase>_time_s"]``: timing the same phase
    twice in one step gives the sum of both.

    Args:
        phase: phase name, e.g. ``"rollout"``, ``"train"``, ``"sync"``, ``"eval"``, ``"save"``.
        store: the step's metrics dict to record into, or None to only set ``elapsed_s``.

    Raises:
        ValueError: ``phase`` is empty or contains whitespace.
    """

    def __init__(self, phase: str, store: dict[str, Any] | None = None):
        if not phase or any(c.isspace() for c in phase):
            raise ValueError(f"timer phase must be a non-empty name without spaces, e.g. 'rollout'; got {phase!r}")
        self.key = phase_key(phase)
        self.store = store
        self.elapsed_s: float | None = None
        self._start: float | None = None

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.elapsed_s = time.perf_counter() - self._start
        if self.store is not None:
            self.store[self.key] = self.store.get(self.key, 0.0) + self.elapsed_s


def phase_key(phase: str) -> str:
    """The metric key of a phase's time: ``"perf/<phase>_time_s"`` (seconds)."""
    return f"perf/{phase}_time_s"


def timed(phase: str, store: dict[str, Any]) -> Timer:
    """``with timed("train", perf): ...`` adds the block's wall time, seconds, to
    ``perf["perf/train_time_s"]``. Same as ``Timer(phase, store)``.

    Raises:
        ValueError: ``phase`` is empty or contains whitespace.
    """
    return Timer(phase, store)

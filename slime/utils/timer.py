"""Wall time of the phases of one rollout step, the ``perf/<phase>_time_s`` metrics (seconds).

The driver wraps each phase (``with timed("rollout", perf): ...``) and logs ``perf`` with the step's
other metrics.  The clock is :func:`time.perf_counter` (monotonic); GPU work counts once the phase waits for it.
"""

from __future__ import annotations

import time
from typing import Any


class Timer:
    """Context manager that measures the wall time of one phase, in seconds, also when the block raises.

    Sets ``elapsed_s`` and, with ``store``, adds it to ``store["perf/<phase>_time_s"]`` (a phase timed
    twice in a step sums).

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
    """``Timer(phase, store)``: ``with timed("train", perf):`` adds the seconds to ``perf["perf/train_time_s"]``.

    Raises:
        ValueError: ``phase`` is empty or contains whitespace.
    """
    return Timer(phase, store)

"""Wall time of the phases of one rollout step, the ``perf/<phase>_time_s`` metrics (seconds).

The driver wraps each phase (``with timed("rollout", perf): ...``) and logs ``perf`` with the step's
other metrics.  The clock is :func:`time.perf_counter` (monotonic); GPU work counts once the phase waits for it.
"""

from __future__ import annotations

import statistics
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


class PhaseClock:
    """Wall times of the sub-phases of one phase, the ``perf/<phase>_<sub>_s`` metrics (seconds).

    ``with clock("forward_backward"): ...`` adds the block's seconds to that sub-phase (a sub-phase entered again
    sums).  On a CUDA ``device`` each boundary first waits for the work queued on the current stream
    (:func:`synchronize_current_stream`), so that GPU work queued in a block is counted in that block and not in the
    next one; work on a side stream (the optimizer state's background onload) goes on across boundaries and counts
    where the current stream first waits for it.  :meth:`metrics` gives the figures,
    :attr:`total_s` their sum.  The train phase's sub-phases and how they add up: ``docs/design/training_step.md``.

    Raises:
        ValueError: ``phase`` or a sub-phase name is empty or contains whitespace.
    """

    def __init__(self, phase: str, device: Any = None):
        self.phase = _checked_name(phase)
        self.seconds: dict[str, float] = {}
        self._cuda = device is not None and getattr(device, "type", device) == "cuda"
        self._device = device

    def _sync(self) -> None:
        if self._cuda:
            synchronize_current_stream(self._device)

    def __call__(self, sub: str) -> "_SubPhase":
        return _SubPhase(self, _checked_name(sub))

    def add(self, sub: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (e.g. by another process) to sub-phase ``sub``."""
        self.seconds[_checked_name(sub)] = self.seconds.get(sub, 0.0) + seconds

    @property
    def total_s(self) -> float:
        """The sum of every sub-phase's seconds."""
        return sum(self.seconds.values())

    def metrics(self) -> dict[str, float]:
        """``{"perf/<phase>_<sub>_s": seconds}`` in the order the sub-phases were first entered."""
        return {sub_phase_key(self.phase, sub): s for sub, s in self.seconds.items()}


class _SubPhase:
    """One ``with clock(sub):`` block of a :class:`PhaseClock` (also when the block raises)."""

    def __init__(self, clock: PhaseClock, sub: str):
        self.clock, self.sub = clock, sub

    def __enter__(self) -> None:
        self.clock._sync()
        self._start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        self.clock._sync()
        self.clock.add(self.sub, time.perf_counter() - self._start)


class MicroBatchClock:
    """Seconds of each micro-batch of a training schedule (its forward and backward), with no host sync per
    micro-batch: ``mark()`` as each micro-batch starts, ``stop()`` after the last.

    On a CUDA ``device`` a mark is an event recorded on the current stream, read in :meth:`seconds` (which waits
    for the last one); elsewhere it is :func:`time.perf_counter`.  The figures locate time inside the
    ``forward_backward`` sub-phase (e.g. whether the first micro-batches, which overlap the optimizer state's
    background onload, run slower); they are not sub-phases and do not add to the train phase.
    """

    def __init__(self, device: Any = None):
        self._cuda = device is not None and getattr(device, "type", device) == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        """A micro-batch starts now (in stream order on CUDA)."""
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    stop = mark
    """The last micro-batch has ended."""

    def seconds(self) -> list[float]:
        """Each micro-batch's seconds, from its mark to the next (the last: to :meth:`stop`)."""
        if len(self._marks) < 2:
            return []
        if self._cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


def micro_batch_metrics(seconds: list[float], tokens: list[int]) -> dict[str, float]:
    """Where the forward-backward time of one optimizer step goes, micro-batch by micro-batch:
    ``perf/micro_batch_{first,median,max}_s`` (seconds) and the tokens/s of the first quarter of the micro-batches
    (at least one) against the rest's, ``perf/micro_batch_{first_quarter,rest}_tokens_per_s`` (the rest's only with
    two or more micro-batches).  Empty without figures.

    Raises:
        ValueError: ``seconds`` and ``tokens`` differ in length.
    """
    if len(seconds) != len(tokens):
        raise ValueError(f"{len(seconds)} micro-batch times for {len(tokens)} micro-batches")
    if not seconds:
        return {}
    out = {"perf/micro_batch_first_s": seconds[0], "perf/micro_batch_median_s": statistics.median(seconds),
           "perf/micro_batch_max_s": max(seconds)}
    quarter = max(1, len(seconds) // 4)
    out["perf/micro_batch_first_quarter_tokens_per_s"] = sum(tokens[:quarter]) / max(sum(seconds[:quarter]), 1e-12)
    if len(seconds) > quarter:
        out["perf/micro_batch_rest_tokens_per_s"] = sum(tokens[quarter:]) / max(sum(seconds[quarter:]), 1e-12)
    return out


def synchronize_current_stream(device: Any) -> None:
    """Block the host until the CUDA ``device``'s current stream has run the work queued on it (and whatever it was
    made to wait for); unlike ``torch.cuda.synchronize``, work queued on other streams may still run."""
    import torch

    torch.cuda.current_stream(device).synchronize()


def sub_phase_key(phase: str, sub: str) -> str:
    """The metric key of a sub-phase's time: ``"perf/<phase>_<sub>_s"`` (seconds)."""
    return f"perf/{phase}_{sub}_s"


def _checked_name(name: str) -> str:
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"timer phase must be a non-empty name without spaces, e.g. 'rollout'; got {name!r}")
    return name


TRAIN_SUB_PHASES = (
    "engine_release", "onload", "parity", "transfer", "checks", "pack", "old_log_probs", "ref_log_probs",
    "forward_backward", "optimizer", "metrics", "offload",
)
"""The sub-phases of the train phase, in order; their ``perf/train_<sub>_s`` add up to ``perf/train_time_s``.

Driver side (:func:`slime.driver.loop`, :class:`slime.driver.ColocatedMemory`): ``engine_release`` (colocated
engines free their GPU memory), ``onload`` (trainers bring parameters, gradient buffers and optimizer state back),
``parity`` (the engine parity check of the first steps), ``transfer`` (the trainer call's time outside the backend:
the samples to the ranks, the metrics back), ``offload`` (optimizer state and gradients leave the GPU).  Trainer
side (:func:`slime.backends.step.train_step`, rank 0): ``checks``, ``pack`` (micro-batch planning and
packing), ``old_log_probs`` (with the mismatch monitor), ``ref_log_probs``, ``forward_backward``, ``optimizer``
(gradient norm, clipping, the update) and ``metrics`` (reductions over ranks)."""
SYNC_SUB_PHASES = ("engine_resume", "push", "offload")
"""The sub-phases of the sync phase: colocated engines take their memory back, the weight push, the trainers'
weights leave the GPU."""

_SHORT = {"engine_release": "release", "old_log_probs": "old_lp", "ref_log_probs": "ref_lp",
          "forward_backward": "fwd_bwd", "engine_resume": "resume"}


def token_rates(tokens: int, metrics: dict[str, float]) -> dict[str, float]:
    """Throughput of one rollout step that trained ``tokens`` tokens (prompt + response of every sample):
    ``perf/train_tokens``, ``perf/train_tokens_per_s`` (over ``perf/train_time_s``) and ``perf/step_tokens_per_s``
    (over the rollout, train and sync phases together; eval and save left out)."""
    out = {"perf/train_tokens": float(tokens)}
    train_s = metrics.get(phase_key("train"), 0.0)
    step_s = train_s + metrics.get(phase_key("rollout"), 0.0) + metrics.get(phase_key("sync"), 0.0)
    if train_s > 0:
        out["perf/train_tokens_per_s"] = tokens / train_s
    if step_s > 0:
        out["perf/step_tokens_per_s"] = tokens / step_s
    return out


def step_line(step: int, metrics: dict[str, Any]) -> str:
    """One log line of a rollout step's times (s) with each phase's sub-phases, its reward and token rate, e.g.
    ``step 3: rollout 3.1 s | train 12.4 s (release 0.4, onload 2.0, old_lp 2.1, fwd_bwd 6.2, ...) | sync 0.3 s
    (resume 0.1, push 0.2) | reward 0.375 | 10.4k tok/s``."""
    parts = []
    for phase, subs in (("rollout", ()), ("train", TRAIN_SUB_PHASES), ("sync", SYNC_SUB_PHASES),
                        ("eval", ()), ("save", ())):
        total = metrics.get(phase_key(phase))
        if total is None:
            continue
        inner = [f"{_SHORT.get(sub, sub)} {metrics[key]:.1f}" for sub in subs
                 if (key := sub_phase_key(phase, sub)) in metrics]
        parts.append(f"{phase} {total:.1f} s" + (f" ({', '.join(inner)})" if inner else ""))
    if "rollout/reward_mean" in metrics:
        parts.append(f"reward {metrics['rollout/reward_mean']:.3f}")
    if "perf/step_tokens_per_s" in metrics:
        parts.append(f"{metrics['perf/step_tokens_per_s'] / 1000:.1f}k tok/s")
    return f"step {step}: " + " | ".join(parts)

"""All rollout engines of a run as one object; each engine runs in its own Ray actor.

Start-up: :class:`RolloutEngineGroup` starts one :class:`EngineActor` per engine on the
engine's first bundle, handing it the :class:`~slime.rollout.engines.base.EngineResources`
of all its bundles; :meth:`RolloutEngineGroup.wait_until_healthy` then polls every engine's
``health()`` until it is True, and fails naming the engine (index, node, bundles, error, log
tail) when one raises or is not healthy within the timeout.

Generation: :meth:`RolloutEngineGroup.generate` keeps the step's requests in one queue and
hands them out as engines free up, so that a slow engine serves fewer requests instead of
holding the step.  Each engine keeps at most its *window* of requests in flight
(:func:`balance_windows`): with one engine its ``capacity``; with ``E > 1`` engines and ``N``
requests in the step, half an even share, ``ceil(ceil(N / E) / 2)`` (at least 1, at most the
engine's ``capacity``).  Each round fills the engines least-free first, each with
``min(free window, ceil(queued / engines left))`` requests (water-filling), sent in calls of
at most ``max_requests_per_call``; whenever a call returns, its engine's window is free again
and the next requests go to it.  So at least half of the step stays in the queue at the
start, and goes to whichever engines return first: a fast engine takes over the tail, also
when the step has fewer requests than the engines could hold at once (a 512-sample step on
two SGLang engines of concurrency 512 starts 128 requests at each, not 256, and the other 256
follow as requests finish).  Outputs come back in request order, one per request.

Why half, and why not per engine type: a window below an even share is what lets the queue
move work off a slow engine, and it has a price when the engines are equally fast.  An engine
that batches per call (transformers) runs two calls of half the size instead of one (the same
work on CPU; on a GPU, decoding is memory-bound, so a half batch takes nearly as long as a full
one); a continuous-batching server (SGLang: one request per call, many calls at once) decodes
a batch of at most half the requests it could while the queue lasts, and the requests that
wait in the queue start later, which lengthens the step's long tail.  Half bounds what a slow
engine holds to half its even share and keeps each engine at half the batch of an even split;
a smaller window (e.g. ``max_requests_per_call``, 1 for a server) would cut the batch of every
engine to a few requests, a larger one leaves too little in the queue to rebalance.  With one
engine nothing needs balancing, so it gets its full ``capacity`` and runs exactly as it would
alone (transformers: batches of ``capacity`` requests, one after the other).  The recipe runs
one SGLang engine per 8-GPU node, so a single-node run has one engine.

Everything else (weights, memory, cache, pause/continue) goes to every engine and waits for
all.  :meth:`RolloutEngineGroup.shutdown` stops every engine and its processes; it is
idempotent and never raises, so it can run in the driver's ``finally``.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Callable

import ray
import torch

from slime.rollout.engines.base import EngineResources, GenerateOutput, GenerateRequest, RolloutEngine

if TYPE_CHECKING:
    from slime.ray.placement import Placement

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0
"""Seconds between two health polls of an engine that answered False during start-up."""
SHUTDOWN_TIMEOUT_S = 60.0
"""Seconds the engines get to stop their processes before their actors are killed."""
_ERROR_CHARS = 2000
"""Characters of an engine's exception (the end of its traceback) quoted in a start-up error."""


class EngineStartError(RuntimeError):
    """One or more rollout engines failed to start; the message names each one and why."""


class EngineError(RuntimeError):
    """A rollout engine failed while serving requests; the message names the engine and the requests."""


class EngineActor:
    """The Ray actor around one :class:`RolloutEngine` (made remote by :func:`engine_actor_class`);
    methods mirror the engine's.

    ``health``, ``log_tail`` and ``shutdown`` run in a concurrency group of their own, so they
    are answered while a ``generate`` call is running; ``generate`` calls run in the
    ``"generate"`` group, ``RolloutEngine.max_concurrent_calls`` at once; every other method
    runs one at a time.
    """

    def __init__(self, engine_factory: Callable[[EngineResources], RolloutEngine], resources: EngineResources):
        prefix = f"[engine {resources.index}]"
        logging.basicConfig(level=logging.INFO, format=f"{prefix} %(levelname)s %(name)s: %(message)s")
        if resources.cpu_threads is not None:
            torch.set_num_threads(resources.cpu_threads)
        if resources.local_gpu_ids:  # Ray left CUDA_VISIBLE_DEVICES to us (NOSET): all the engine's GPUs here
            os.environ["CUDA_VISIBLE_DEVICES"] = resources.local_cuda_visible_devices
        self.resources = resources
        try:
            self.engine = engine_factory(resources)
        except BaseException:
            kill_descendants(os.getpid())  # what a failing constructor started would outlive the actor
            raise

    def limits(self) -> tuple[int, int]:
        """``(capacity, max_requests_per_call)`` of the engine."""
        return self.engine.capacity, self.engine.max_requests_per_call

    @ray.method(concurrency_group="generate")
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        return self.engine.generate(requests)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        self.engine.update_weights_from_tensor(named_tensors, flush_cache=flush_cache)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.engine.resume_memory_occupation(tags)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def pause_generation(self) -> None:
        self.engine.pause_generation()

    def continue_generation(self) -> None:
        self.engine.continue_generation()

    @ray.method(concurrency_group="control")
    def health(self) -> bool:
        return self.engine.health()

    @ray.method(concurrency_group="control")
    def log_tail(self) -> str:
        return self.engine.log_tail()

    @ray.method(concurrency_group="control")
    def shutdown(self) -> list[str]:
        """``engine.shutdown()``, then SIGKILL every process this actor started that is still alive.

        Returns:
            One line per process killed that way (the engine left it running), for the driver's log.
        """
        try:
            self.engine.shutdown()
        finally:
            leftovers = kill_descendants(os.getpid())
        return leftovers


@functools.lru_cache(maxsize=None)
def engine_actor_class(max_concurrent_calls: int):
    """:class:`EngineActor` as a Ray actor class running ``max_concurrent_calls`` ``generate`` calls
    at once (Ray fixes concurrency groups per class, not per ``.options()``)."""
    return ray.remote(concurrency_groups={"control": 1, "generate": max_concurrent_calls})(EngineActor)


def kill_descendants(pid: int) -> list[str]:
    """SIGKILL every live descendant of process ``pid`` (read from Linux ``/proc``; nothing
    elsewhere).  Returns ``"pid N: command"`` for each one killed."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    commands: dict[int, str] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                commands[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state not in ("Z", "X"):
            children[int(ppid)].append(int(name))
    killed, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        stack.extend(children.get(child, []))
        try:
            os.kill(child, signal.SIGKILL)
            killed.append(f"pid {child}: {commands.get(child, '')[:200]}")
        except ProcessLookupError:
            pass
    return killed


class RolloutEngineGroup:
    """The run's rollout engines: start-up, generation balanced over engines, broadcasts, shutdown.

    The constructor starts the engine actors and returns at once (they load their models in the
    background); call :meth:`wait_until_healthy` before anything else.

    Args:
        placement: where the engines go (:attr:`Placement.engine_resources`, :meth:`Placement.engine_options`).
        engine_factory: picklable ``(EngineResources) -> RolloutEngine``, run inside each actor,
            e.g. ``functools.partial(engine_cls.from_config, cfg)``.
        max_concurrent_calls: the engine class's :attr:`RolloutEngine.max_concurrent_calls`.
    """

    def __init__(
        self,
        placement: Placement,
        engine_factory: Callable[[EngineResources], RolloutEngine],
        max_concurrent_calls: int = 1,
    ):
        if not isinstance(max_concurrent_calls, int) or max_concurrent_calls < 1:
            raise ValueError(f"max_concurrent_calls must be an int >= 1, got {max_concurrent_calls!r}")
        self.resources: list[EngineResources] = list(placement.engine_resources)
        self.actors = []
        self._limits: list[tuple[int, int]] | None = None
        self._shut_down = False
        actor_class = engine_actor_class(max_concurrent_calls)
        try:
            for i, resources in enumerate(self.resources):
                self.actors.append(actor_class.options(**placement.engine_options(i)).remote(engine_factory, resources))
        except BaseException:
            self.shutdown()  # the ones already started
            raise

    def __len__(self) -> int:
        return len(self.actors)

    # -- start-up --------------------------------------------------------------------------

    def wait_until_healthy(self, timeout_s: float) -> None:
        """Poll every engine's ``health()`` until all are True (``--rollout-engine-start-timeout``).

        Raises:
            EngineStartError: an engine raised (its constructor or ``health()``), or is not
                healthy ``timeout_s`` seconds after this call; the message names every such
                engine with its node, bundles, state, exception and log tail.  Every engine
                is shut down before it is raised.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        polls = {actor.health.remote(): i for i, actor in enumerate(self.actors)}  # in flight
        retry_at: dict[int, float] = {}  # engines that answered False, and when to ask again
        state = {i: "still starting (its constructor has not returned)" for i in range(len(self.actors))}
        failed: dict[int, str] = {}
        while (polls or retry_at) and not failed and time.monotonic() < deadline:
            now = time.monotonic()
            for i in [i for i, when in retry_at.items() if when <= now]:
                polls[self.actors[i].health.remote()] = i
                del retry_at[i]
            wait_s = max(0.0, min([deadline - now, HEALTH_POLL_S, *(t - now for t in retry_at.values())]))
            if not polls:
                time.sleep(wait_s)  # only engines that answered False: wait for their next poll
                continue
            ready, _ = ray.wait(list(polls), num_returns=1, timeout=wait_s)
            for ref in ready:
                i = polls.pop(ref)
                try:
                    healthy = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - reported with the engine's name below
                    failed[i] = f"raised {_error_tail(e)}"
                    continue
                if healthy:
                    logger.info("rollout %s is healthy after %.1f s", self.resources[i].describe(),
                                time.monotonic() - started)
                else:
                    state[i] = "health() returned False"
                    retry_at[i] = time.monotonic() + HEALTH_POLL_S
        not_ready = sorted(set(polls.values()) | set(retry_at))
        if failed or not_ready:
            if failed:
                reasons = failed
            else:
                reasons = {i: f"not healthy within --rollout-engine-start-timeout {timeout_s:g} s: {state[i]}"
                           for i in not_ready}
            lines = [f"rollout {self.resources[i].describe()} {why}{self._log_tail(i, state[i])}"
                     for i, why in sorted(reasons.items())]
            self.shutdown()
            raise EngineStartError(
                f"{len(reasons)} of {len(self.actors)} rollout engine(s) failed to start:\n" + "\n".join(lines)
            )
        limits = ray.get([a.limits.remote() for a in self.actors])
        bad = [(i, lim) for i, lim in enumerate(limits) if not all(isinstance(v, int) and v >= 1 for v in lim)]
        if bad:
            self.shutdown()
            raise EngineStartError(
                "a rollout engine's capacity and max_requests_per_call must be ints >= 1, got "
                + ", ".join(f"{lim!r} from {self.resources[i].describe()}" for i, lim in bad)
            )
        self._limits = limits

    def _log_tail(self, index: int, state: str | None) -> str:
        """``"; log tail: ..."`` from an engine that answers (its constructor returned), else ``""``."""
        if state != "health() returned False":
            return ""
        try:
            tail = ray.get(self.actors[index].log_tail.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the tail is a courtesy
            return ""
        return f"; log tail:\n{tail[-_ERROR_CHARS:]}" if tail else ""

    # -- generation --------------------------------------------------------------------------

    @property
    def capacities(self) -> list[int]:
        """Per engine, the most requests in flight at it (after :meth:`wait_until_healthy`)."""
        return [capacity for capacity, _ in self._checked_limits()]

    def _checked_limits(self) -> list[tuple[int, int]]:
        if self._limits is None:
            raise RuntimeError("the rollout engines have not been checked yet; call wait_until_healthy() first")
        return self._limits

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete ``requests`` on all engines (see the module docstring for the schedule).

        Returns:
            One output per request, in request order; ``engine_index`` says which engine served it.

        Raises:
            EngineError: an engine raised or died, or returned a wrong number of outputs; the
                message names the engine and the first request ids of its call.
        """
        limits = self._checked_limits()
        windows = balance_windows(len(requests), [capacity for capacity, _ in limits])
        outputs: list[GenerateOutput | None] = [None] * len(requests)
        queue = collections.deque(range(len(requests)))
        in_flight = [0] * len(self.actors)  # requests sent to each engine and not yet back
        running: dict[ray.ObjectRef, tuple[int, list[int]]] = {}
        while queue or running:
            free = sorted((windows[e] - in_flight[e], e) for e in range(len(self.actors)))
            free = [(room, e) for room, e in free if room > 0]
            for k, (room, engine) in enumerate(free):  # least free first: water-filling
                share = min(room, math.ceil(len(queue) / (len(free) - k)))
                while share > 0:
                    batch = [queue.popleft() for _ in range(min(share, limits[engine][1]))]
                    running[self.actors[engine].generate.remote([requests[i] for i in batch])] = (engine, batch)
                    in_flight[engine] += len(batch)
                    share -= len(batch)
            (ref,), _ = ray.wait(list(running), num_returns=1)
            engine, batch = running.pop(ref)
            in_flight[engine] -= len(batch)
            try:
                results = ray.get(ref)
            except Exception as e:
                raise EngineError(
                    f"rollout {self.resources[engine].describe()} failed on {len(batch)} request(s) "
                    f"({_rids(requests, batch)}): {_error_tail(e)}"
                ) from e
            if len(results) != len(batch):
                raise EngineError(
                    f"rollout {self.resources[engine].describe()} returned {len(results)} outputs for "
                    f"{len(batch)} requests ({_rids(requests, batch)}); an engine returns one output per request"
                )
            for i, out in zip(batch, results):
                out.engine_index = engine
                outputs[i] = out
        return outputs  # every index was in exactly one batch, and each batch filled its own

    # -- broadcasts ---------------------------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every engine frees the memory regions ``tags`` (SGLang tags; ``None``: all), see
        :meth:`RolloutEngine.release_memory_occupation`."""
        ray.get([a.release_memory_occupation.remote(tags) for a in self.actors])

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every engine re-allocates the regions ``tags`` (``None``: all), see
        :meth:`RolloutEngine.resume_memory_occupation`."""
        ray.get([a.resume_memory_occupation.remote(tags) for a in self.actors])

    def flush_cache(self) -> None:
        ray.get([a.flush_cache.remote() for a in self.actors])

    def pause_generation(self) -> None:
        """Every engine stops admitting requests (SGLang ``/pause_generation``), see
        :meth:`RolloutEngine.pause_generation`."""
        ray.get([a.pause_generation.remote() for a in self.actors])

    def continue_generation(self) -> None:
        """Every engine admits requests again (SGLang ``/continue_generation``)."""
        ray.get([a.continue_generation.remote() for a in self.actors])

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every engine (``engine.shutdown()``, then any process its actor left), then kill the actors.

        Idempotent, and never raises: problems are logged, so that it can run in a ``finally``
        without hiding the error that ended the run.  An engine that does not stop within
        ``timeout_s`` (e.g. its constructor hangs) has its actor killed; the log says that
        processes it started may survive.
        """
        if self._shut_down:
            return
        self._shut_down = True
        try:
            refs = [a.shutdown.remote() for a in self.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for i, ref in enumerate(refs):
                what = f"rollout {self.resources[i].describe()}"
                if ref not in ready:
                    logger.warning("%s did not shut down within %.0f s; killing its actor (processes it started "
                                   "may survive it)", what, timeout_s)
                    continue
                try:
                    leftovers = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - an actor that never started, or a failing shutdown()
                    logger.warning("%s: shutdown failed: %s", what, _error_tail(e, 500))
                    continue
                if leftovers:
                    logger.warning("%s left %d process(es) running after shutdown(); killed: %s",
                                   what, len(leftovers), "; ".join(leftovers))
        except Exception as e:  # noqa: BLE001 - e.g. Ray already disconnected
            logger.warning("rollout engines: shutdown failed: %s", e)
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception as e:  # noqa: BLE001
                logger.warning("could not kill a rollout engine actor: %s", e)


def balance_windows(num_requests: int, capacities: list[int]) -> list[int]:
    """The most requests :meth:`RolloutEngineGroup.generate` keeps in flight at each engine in a
    step of ``num_requests`` requests (see the module docstring for the reason).

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


def _error_tail(error: BaseException, chars: int = _ERROR_CHARS) -> str:
    """The end of an exception's text (a Ray error carries the remote traceback, whose end matters)."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= chars else "..." + text[-chars:]


def _rids(requests: list[GenerateRequest], batch: list[int], shown: int = 3) -> str:
    names = [f"#{i}" + (f" rid {requests[i].rid}" if requests[i].rid is not None else "") for i in batch[:shown]]
    return ", ".join(names) + (f", ... ({len(batch)} in all)" if len(batch) > shown else "")

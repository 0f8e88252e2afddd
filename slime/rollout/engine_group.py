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
one); a continuous-batching server (SGLang: batched calls of up to ``--sglang-requests-per-call``,
many calls at once) decodes
a batch of at most half the requests it could while the queue lasts, and the requests that
wait in the queue start later, which lengthens the step's long tail.  Half bounds what a slow
engine holds to half its even share and keeps each engine at half the batch of an even split;
a smaller window (e.g. ``max_requests_per_call``) would cut the batch of every
engine to a few requests, a larger one leaves too little in the queue to rebalance.  With one
engine nothing needs balancing, so it gets its full ``capacity`` and runs exactly as it would
alone (transformers: batches of ``capacity`` requests, one after the other).  The recipe runs
one SGLang engine per 8-GPU node, so a single-node run has one engine.

Faults: an engine whose call raises :class:`~slime.rollout.engines.base.EngineUnavailableError`
(its server died), whose actor died, or whose ``health()`` turns False while it has requests (polled
every :data:`HEALTH_MONITOR_S` seconds without an answer) leaves the rotation at once: its requests in
flight go back to the front of the queue for the other engines (each request is answered exactly
once: results of abandoned calls are never read), and it is restarted (``engine.restart()``, or a
new actor where the old one died).  ``generate`` returns once the restarted engines are healthy
again; they serve again after the next weight sync (:meth:`RolloutEngineGroup.weights_updated`),
so no sample comes from stale weights.  When no engine is left serving while requests wait (one
engine, or all of them down), ``generate`` waits for the restarts and calls the driver's re-sync
hook (:meth:`RolloutEngineGroup.set_resync`: the trainers push their current weights, which are the
ones the rollout started with, into every engine, inside the colocated memory hand-over), then
serves the queued requests on the re-synced engines (``fault_counts["mid_rollout_resyncs"]``);
without a hook it fails.  This cannot loop: each re-sync follows a failure of an engine with
requests in flight, which counts one more attempt for each of them, and a request sent
:data:`MAX_ATTEMPTS` times stops the step.  Other errors (a refused request, a restart that fails)
stop the step as before.

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

from slime.rollout.engines.base import (
    EngineResources,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
)

if TYPE_CHECKING:
    from slime.ray.placement import Placement

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0
"""Seconds between two health polls of an engine that answered False during start-up."""
HEALTH_MONITOR_S = 10.0
"""Seconds without any answer during ``generate`` after which the engines with requests in flight are asked
for their health."""
MAX_ATTEMPTS = 3
"""Times one request is sent before its engines' failures stop the step."""
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

    def update_weights_from_ipc(self, serialized_per_tp_rank: list[str]) -> None:
        self.engine.update_weights_from_ipc(serialized_per_tp_rank)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str) -> None:
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str) -> None:
        self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.engine.destroy_weights_update_group(group_name)

    def restart(self) -> None:
        self.engine.restart()

    @ray.method(concurrency_group="control")
    def memory_info(self) -> dict[str, float]:
        return self.engine.memory_info()

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
        self._placement, self._engine_factory = placement, engine_factory
        self._actor_class = engine_actor_class(max_concurrent_calls)
        self.serving: list[bool] = [True] * len(self.resources)
        """Per engine: whether it gets requests (False from its failure until the sync after its restart)."""
        self._restarted: set[int] = set()  # restarted and healthy, waiting for the current weights
        self._restarts: dict[int, dict] = {}  # in progress: {"ref": restart call or health poll, "deadline": ...}
        self.restart_timeout_s = 1800.0
        self.epoch = 0
        """Incremented whenever an engine is restarted, in place or as a new actor: the transports reconnect
        (a new actor has new handles; a new server joined none of the NCCL weight-update groups)."""
        self.fault_counts: collections.Counter = collections.Counter()
        """``engine_failures``, ``requests_retried``, ``engines_restarted``, ``mid_rollout_resyncs`` since the
        start (for the metrics)."""
        self._resync: Callable[[], None] | None = None  # set_resync()
        try:
            for i in range(len(self.resources)):
                self.actors.append(self._new_actor(i))
        except BaseException:
            self.shutdown()  # the ones already started
            raise

    def _new_actor(self, index: int):
        return self._actor_class.options(**self._placement.engine_options(index)).remote(
            self._engine_factory, self.resources[index]
        )

    def __len__(self) -> int:
        return len(self.actors)

    def set_resync(self, resync: Callable[[], None] | None) -> None:
        """Let :meth:`generate` re-sync restarted engines mid-rollout when no other engine is left to serve.

        Args:
            resync: called with no arguments once every engine being restarted is healthy again; it must push
                the current policy weights into every engine and end with :meth:`weights_updated` (the driver
                passes :func:`slime.driver.resync_engines`, i.e. ``trainers.update_weights(engines)`` inside the
                colocated memory hand-over).  ``None`` turns the re-sync off: a rollout with no engine left then
                fails (:class:`EngineError`).
        """
        if resync is not None and not callable(resync):
            raise TypeError(f"set_resync() takes a callable or None, got {resync!r}")
        self._resync = resync

    # -- start-up --------------------------------------------------------------------------

    def wait_until_healthy(self, timeout_s: float) -> None:
        """Poll every engine's ``health()`` until all are True (``--rollout-engine-start-timeout``).

        Raises:
            EngineStartError: an engine raised (its constructor or ``health()``), or is not
                healthy ``timeout_s`` seconds after this call; the message names every such
                engine with its node, bundles, state, exception and log tail.  Every engine
                is shut down before it is raised.
        """
        self.restart_timeout_s = timeout_s
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
        """Complete ``requests`` on the serving engines (see the module docstring for the schedule and faults).

        Returns:
            One output per request, in request order; ``engine_index`` says which engine served it.

        Raises:
            EngineError: an engine raised another error than :class:`EngineUnavailableError`, returned a
                wrong number of outputs, a request failed :data:`MAX_ATTEMPTS` times, no engine is left
                to serve (and none could be re-synced, :meth:`set_resync`), a failed engine could not be
                restarted, or the mid-rollout re-sync raised; the message names the engine and the first
                request ids concerned.
        """
        limits = self._checked_limits()
        windows = balance_windows(len(requests), [capacity for capacity, _ in limits])
        outputs: list[GenerateOutput | None] = [None] * len(requests)
        attempts = [0] * len(requests)
        queue = collections.deque(range(len(requests)))
        in_flight = [0] * len(self.actors)  # requests sent to each engine and not yet back
        running: dict[ray.ObjectRef, tuple[int, list[int]]] = {}

        def requeue(engine: int, batch: list[int], why: str) -> None:
            for i in batch:
                attempts[i] += 1
            exhausted = [i for i in batch if attempts[i] >= MAX_ATTEMPTS]
            if exhausted:
                raise EngineError(f"{len(exhausted)} request(s) ({_rids(requests, exhausted)}) failed on "
                                  f"{MAX_ATTEMPTS} engines; last: rollout {self.resources[engine].describe()} {why}")
            queue.extendleft(reversed(batch))
            self.fault_counts["requests_retried"] += len(batch)

        def fail(engine: int, why: str, actor_died: bool = False) -> None:
            """Take ``engine`` out, requeue everything it holds, start its restart."""
            for ref in [r for r, (e, _) in running.items() if e == engine]:
                requeue(engine, running.pop(ref)[1], why)
            in_flight[engine] = 0
            self._fail(engine, why, actor_died)

        while queue or running:
            free = sorted((windows[e] - in_flight[e], e) for e in range(len(self.actors)) if self.serving[e])
            free = [(room, e) for room, e in free if room > 0]
            for k, (room, engine) in enumerate(free):  # least free first: water-filling
                share = min(room, math.ceil(len(queue) / (len(free) - k)))
                while share > 0:
                    batch = [queue.popleft() for _ in range(min(share, limits[engine][1]))]
                    running[self.actors[engine].generate.remote([requests[i] for i in batch])] = (engine, batch)
                    in_flight[engine] += len(batch)
                    share -= len(batch)
            if not running:  # requests queued, and no engine serves
                self._resync_mid_rollout(requests, list(queue))
                continue
            ready, _ = ray.wait(list(running), num_returns=1, timeout=HEALTH_MONITOR_S)
            if not ready:
                for engine, why in self._unhealthy({e for e, _ in running.values()}).items():
                    fail(engine, why)
                continue
            ref = ready[0]
            engine, batch = running.pop(ref)
            in_flight[engine] -= len(batch)
            try:
                results = ray.get(ref)
            except Exception as e:
                actor_died = isinstance(e, ray.exceptions.RayActorError)
                if actor_died or isinstance(e, EngineUnavailableError):
                    requeue(engine, batch, f"failed: {_error_tail(e, 500)}")
                    fail(engine, _error_tail(e, 500), actor_died)
                    continue
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
                if out.rid is not None and requests[i].rid is not None and out.rid != requests[i].rid:
                    raise EngineError(f"rollout {self.resources[engine].describe()} answered request "
                                      f"{requests[i].rid!r} with the output of {out.rid!r}")
                out.engine_index = engine
                outputs[i] = out
        self.wait_for_restarts()
        return outputs  # every index was answered by exactly one call (abandoned calls are never read)

    # -- faults -------------------------------------------------------------------------------

    def _resync_mid_rollout(self, requests: list[GenerateRequest], queued: list[int]) -> None:
        """No engine serves and ``queued`` requests wait: wait for the restarts, then re-sync the engines
        through the :meth:`set_resync` hook, so that the restarted ones serve the rest of the rollout.

        Raises:
            EngineError: no hook is set, or no engine is being restarted or waiting for the weights (nothing
                to re-sync); a restart failed (:meth:`wait_for_restarts`); the hook raised, or returned without
                any engine serving (it did not end with :meth:`weights_updated`).
        """
        left = f"no rollout engine is left to serve {len(queued)} request(s) ({_rids(requests, queued)})"
        if self._resync is None or not (self._restarts or self._restarted):
            raise EngineError(f"{left}: {self._fault_summary()}")
        logger.warning("%s (%s): re-syncing the restarted engines with the current weights mid-rollout", left,
                       self._fault_summary())
        self.wait_for_restarts()
        try:
            self._resync()
        except Exception as e:
            raise EngineError(f"{left}, and re-syncing the restarted engines failed: {_error_tail(e)}") from e
        if not any(self.serving):
            raise EngineError(f"{left}: the mid-rollout re-sync returned, but no engine serves (a re-sync hook "
                              f"must end with weights_updated()): {self._fault_summary()}")
        self.fault_counts["mid_rollout_resyncs"] += 1
        logger.info("rollout engines re-synced mid-rollout; %d request(s) go on", len(queued))

    def _unhealthy(self, engines: set[int]) -> dict[int, str]:
        """Engines of ``engines`` whose ``health()`` is False, raises, or does not answer in time -> why."""
        refs = {self.actors[e].health.remote(): e for e in engines}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=HEALTH_MONITOR_S)
        bad = {refs[r]: "did not answer its health check in time" for r in refs if r not in ready}
        for ref in ready:
            try:
                if not ray.get(ref):
                    bad[refs[ref]] = "reported itself unhealthy"
            except Exception as e:  # noqa: BLE001 - the engine is reported below
                bad[refs[ref]] = f"health check raised {_error_tail(e, 500)}"
        return bad

    def _fail(self, engine: int, why: str, actor_died: bool = False) -> None:
        """Take ``engine`` out of the rotation and start its restart (once per failure)."""
        if engine in self._restarts:
            return  # already restarting
        self.serving[engine] = False
        self._restarted.discard(engine)
        self.fault_counts["engine_failures"] += 1
        logger.warning("rollout %s failed (%s); its requests go to the other engines, and it is restarted",
                       self.resources[engine].describe(), why)
        if actor_died:
            try:
                ray.kill(self.actors[engine])
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.actors[engine] = self._new_actor(engine)
            ref = self.actors[engine].health.remote()
        else:
            ref = self.actors[engine].restart.remote()
        self.epoch += 1  # a new server either way: it is in no weight-update group (NCCL) the transport made
        self._restarts[engine] = {"ref": ref, "restart": not actor_died,
                                  "deadline": time.monotonic() + self.restart_timeout_s}

    def wait_for_restarts(self) -> None:
        """Block until every engine being restarted is healthy (then it waits for :meth:`weights_updated`).

        Raises:
            EngineError: a restart failed or took longer than ``--rollout-engine-start-timeout``.
        """
        while self._restarts:
            engine, state = next(iter(self._restarts.items()))
            what = f"rollout {self.resources[engine].describe()}"
            ready, _ = ray.wait([state["ref"]], timeout=max(0.0, state["deadline"] - time.monotonic()))
            if not ready:
                del self._restarts[engine]
                raise EngineError(f"{what} was not healthy within {self.restart_timeout_s:g} s of its restart"
                                  f"{self._log_tail(engine, 'health() returned False')}")
            try:
                result = ray.get(state["ref"])
            except Exception as e:
                del self._restarts[engine]
                raise EngineError(f"{what} could not be restarted: {_error_tail(e)}") from e
            if state["restart"]:  # restart() returned: the new server is starting
                state["restart"] = False
            elif result:  # healthy
                del self._restarts[engine]
                self._restarted.add(engine)
                self.fault_counts["engines_restarted"] += 1
                logger.info("%s is up again; it serves after the next weight sync", what)
                continue
            else:
                time.sleep(HEALTH_POLL_S)
            state["ref"] = self.actors[engine].health.remote()

    def weights_updated(self) -> None:
        """Called after every weight sync (all engines received the current weights): restarted engines serve again."""
        for engine in sorted(self._restarted):
            self.serving[engine] = True
        self._restarted.clear()

    def _fault_summary(self) -> str:
        out = [f"{self.resources[e].describe()}: {'restarting' if e in self._restarts else 'waiting for the next sync'}"
               for e in range(len(self.actors)) if not self.serving[e]]
        return "; ".join(out) or "none failed"

    def memory_info(self) -> list[dict[str, float]]:
        """Every engine's :meth:`RolloutEngine.memory_info` (GPU memory figures), in engine order."""
        return ray.get([a.memory_info.remote() for a in self.actors])

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

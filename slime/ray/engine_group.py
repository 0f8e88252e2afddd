"""All rollout engines of a run as one object; each engine runs in its own Ray actor (:mod:`.engine_actor`).

- Start-up: :class:`RolloutEngineGroup` starts one actor per engine on the engine's first bundle and
  returns; :meth:`~RolloutEngineGroup.wait_until_healthy` polls every engine's ``health()`` until it is
  True, and fails naming each engine (index, node, bundles, error, log tail) that raises or is not healthy
  within the timeout.
- Generation: :meth:`~RolloutEngineGroup.generate` runs the step on a
  :class:`slime.rollout.scheduler.RequestScheduler`, to which the group is the engine pool.
- Faults: an engine the scheduler takes out stops serving and is restarted (``engine.restart()``, or a
  new actor where the old one died); once healthy it waits, and serves again after the next weight sync
  (:meth:`~RolloutEngineGroup.weights_updated`), so no sample comes from stale weights.
  ``fault_counts`` holds ``engine_failures``, ``requests_retried``, ``engines_restarted`` and
  ``mid_rollout_resyncs`` since the start (the metrics).
- Everything else (weights, memory, cache, pause/continue) goes to every engine and waits for all.
  :meth:`~RolloutEngineGroup.shutdown` stops every engine and its processes; it is idempotent and never
  raises, so it can run in the driver's ``finally``.

Rationale: ``docs/design/engine_group.md``.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Callable

import ray

from slime.errors import SlimeError
from slime.ray.engine_actor import engine_actor_class
from slime.rollout.engines.base import (
    EngineResources,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
)
from slime.rollout.scheduler import (
    ERROR_CHARS,
    EngineDown,
    EngineError,
    EngineState,
    OutputsCallback,
    RequestScheduler,
    error_tail,
)

if TYPE_CHECKING:
    from slime.ray.placement import Placement

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0
"""Seconds between two health polls of an engine that answered False (start-up, restarts)."""
SHUTDOWN_TIMEOUT_S = 60.0
"""Seconds the engines get to stop their processes before their actors are killed."""


class EngineStartError(SlimeError, RuntimeError):
    """One or more rollout engines failed to start; the message names each one and why."""


class RolloutEngineGroup:
    """The run's rollout engines: start-up, generation balanced over engines, restarts, broadcasts, shutdown.

    The constructor starts the engine actors and returns at once (they load their models in the
    background); call :meth:`wait_until_healthy` before anything else.

    Args:
        placement: where the engines go (:attr:`Placement.engine_resources`, :meth:`Placement.engine_options`).
        engine_factory: picklable ``(EngineResources) -> RolloutEngine``, run inside each actor,
            e.g. ``functools.partial(engine_cls.from_spec, cfg.engine_spec(engine_cls.parity_check))``.
        max_concurrent_calls: the engine class's :attr:`RolloutEngine.max_concurrent_calls`.

    Raises:
        ValueError: ``max_concurrent_calls`` is not an int >= 1.
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
        self.scheduler = RequestScheduler(_RayEnginePool(self), self.fault_counts)
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

        ``resync()`` runs once every restarting engine is healthy; it must push the current weights into every
        engine and end with :meth:`weights_updated` (the driver's :func:`slime.driver.resync_engines`).  ``None``:
        a rollout with no engine left fails (:class:`EngineError`).

        Raises:
            TypeError: ``resync`` is neither callable nor None.
        """
        if resync is not None and not callable(resync):
            raise TypeError(f"set_resync() takes a callable or None, got {resync!r}")
        self.scheduler.resync = resync

    # -- start-up --------------------------------------------------------------------------

    def wait_until_healthy(self, timeout_s: float) -> None:
        """Poll every engine's ``health()`` until all are True (``--rollout-engine-start-timeout``); the same
        timeout then bounds each restart.

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
                    failed[i] = f"raised {error_tail(e)}"
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
        return f"; log tail:\n{tail[-ERROR_CHARS:]}" if tail else ""

    # -- generation --------------------------------------------------------------------------

    @property
    def capacities(self) -> list[int]:
        """Per engine, the most requests in flight at it (after :meth:`wait_until_healthy`)."""
        return [capacity for capacity, _ in self._checked_limits()]

    def _checked_limits(self) -> list[tuple[int, int]]:
        if self._limits is None:
            raise RuntimeError("the rollout engines have not been checked yet; call wait_until_healthy() first")
        return self._limits

    def generate(self, requests: list[GenerateRequest],
                 on_outputs: OutputsCallback | None = None) -> list[GenerateOutput | None]:
        """Complete ``requests`` on the serving engines (:meth:`RequestScheduler.generate`; ``on_outputs``
        streams each call's outputs and may add requests or stop the step, aborting the calls in flight).

        Returns:
            One output per request, in request order; ``engine_index`` says which engine served it (None: not
            sent before a stop).

        Raises:
            EngineError: see :meth:`RequestScheduler.generate`; also a failed engine that could not be
                restarted (:meth:`wait_for_restarts`).
        """
        return self.scheduler.generate(requests, self._checked_limits(), on_outputs)

    # -- faults -------------------------------------------------------------------------------

    def engine_state(self, engine: int) -> EngineState:
        """Where ``engine`` is in its fault cycle (:class:`~slime.rollout.scheduler.EngineState`)."""
        if self.serving[engine]:
            return EngineState.SERVING
        if engine in self._restarts:
            return EngineState.RESTARTING
        return EngineState.RESTARTED if engine in self._restarted else EngineState.DOWN

    def _unhealthy(self, engines: set[int], timeout_s: float) -> dict[int, str]:
        """Engines of ``engines`` whose ``health()`` is False, raises, or does not answer in time -> why."""
        refs = {self.actors[e].health.remote(): e for e in engines}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        bad = {refs[r]: "did not answer its health check in time" for r in refs if r not in ready}
        for ref in ready:
            try:
                if not ray.get(ref):
                    bad[refs[ref]] = "reported itself unhealthy"
            except Exception as e:  # noqa: BLE001 - the engine is reported below
                bad[refs[ref]] = f"health check raised {error_tail(e, 500)}"
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
                raise EngineError(f"{what} could not be restarted: {error_tail(e)}") from e
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
        """Every weight sync ends with this (each transport's ``end_sync``, once all engines received the current
        weights, before generation continues): every engine flushes its cache (prefixes cached under the old
        weights), and restarted engines serve again."""
        self.flush_cache()
        for engine in sorted(self._restarted):
            self.serving[engine] = True
        self._restarted.clear()

    def memory_info(self) -> list[dict[str, float]]:
        """Every engine's :meth:`RolloutEngine.memory_info` (GPU memory figures), in engine order."""
        return ray.get([a.memory_info.remote() for a in self.actors])

    # -- broadcasts ---------------------------------------------------------------------------

    def release_memory(self, tags: list[str] | None = None, measure: bool = False) -> tuple[float, float] | None:
        """Every engine frees the memory regions ``tags`` (SGLang tags; ``None``: all), see
        :meth:`RolloutEngine.release_memory_occupation`.

        Returns:
            With ``measure``: the free memory (GiB per GPU) of the engines' fullest GPU before and after the
            release, from :meth:`memory_info` (None where no engine reports a GPU); else None.
        """
        before = self._fullest_free_gib() if measure else None
        ray.get([a.release_memory_occupation.remote(tags) for a in self.actors])
        return None if before is None else (before, self._fullest_free_gib())

    def _fullest_free_gib(self) -> float | None:
        infos = [info for info in self.memory_info() if info.get("gpus")]
        return min(info["free_gib"] / info["gpus"] for info in infos) if infos else None

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

    def abort_requests(self, engines: set[int]) -> None:
        """:meth:`RolloutEngine.abort_requests` on ``engines`` (a stopped dynamic-sampling step)."""
        ray.get([self.actors[e].abort_requests.remote() for e in sorted(engines)])

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
                    logger.warning("%s: shutdown failed: %s", what, error_tail(e, 500))
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


class _RayEnginePool:
    """The group as the scheduler's :class:`~slime.rollout.scheduler.EnginePool`: calls are Ray object refs."""

    def __init__(self, group: RolloutEngineGroup):
        self.group = group

    def state(self, engine: int) -> EngineState:
        return self.group.engine_state(engine)

    def describe(self, engine: int) -> str:
        return self.group.resources[engine].describe()

    def submit(self, engine: int, requests: list[GenerateRequest]) -> ray.ObjectRef:
        return self.group.actors[engine].generate.remote(requests)

    def wait(self, calls: list[ray.ObjectRef], timeout_s: float) -> ray.ObjectRef | None:
        ready, _ = ray.wait(calls, num_returns=1, timeout=timeout_s)
        return ready[0] if ready else None

    def result(self, call: ray.ObjectRef) -> list[GenerateOutput]:
        try:
            return ray.get(call)
        except (ray.exceptions.RayActorError, EngineUnavailableError) as e:  # its server or its actor died
            raise EngineDown(error_tail(e, 500), e) from e

    def unhealthy(self, engines: set[int], timeout_s: float) -> dict[int, str]:
        return self.group._unhealthy(engines, timeout_s)

    def fail(self, engine: int, why: str, cause: BaseException | None) -> None:
        self.group._fail(engine, why, actor_died=isinstance(cause, ray.exceptions.RayActorError))

    def wait_for_restarts(self) -> None:
        self.group.wait_for_restarts()

    def abort(self, engines: set[int]) -> None:
        self.group.abort_requests(engines)

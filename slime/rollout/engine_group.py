"""All rollout engines of a run as one object; each engine runs in its own Ray actor.

:meth:`RolloutEngineGroup.generate` splits a list of requests into contiguous, nearly
equal chunks, one per engine, runs them concurrently and returns the outputs in request
order. The memory and cache methods broadcast to every engine and wait for all.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import ray
import torch

from slime.rollout.engines.base import GenerateOutput, GenerateRequest, RolloutEngine

logger = logging.getLogger(__name__)


@ray.remote
class EngineActor:
    """Ray actor around one :class:`RolloutEngine`; methods mirror the engine's."""

    def __init__(self, engine_factory: Callable[[], RolloutEngine], cpu_threads: int | None):
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        logging.basicConfig(level=logging.INFO, format="[engine] %(levelname)s %(name)s: %(message)s")
        self.engine = engine_factory()

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

    def health(self) -> bool:
        return self.engine.health()

    def shutdown(self) -> None:
        self.engine.shutdown()


class RolloutEngineGroup:
    """The run's rollout engines.

    Args:
        actor_options: per engine, the Ray ``.options(...)`` that place it.
        engine_factory: picklable ``(engine_index) -> RolloutEngine`` building one engine
            inside its actor.
        cpu_threads: torch threads per engine on CPU machines (None on GPU).
    """

    def __init__(self, actor_options: list[dict], engine_factory: Callable[[int], RolloutEngine], cpu_threads: int | None):
        self.actors = [
            EngineActor.options(**opts).remote(functools.partial(engine_factory, i), cpu_threads)
            for i, opts in enumerate(actor_options)
        ]
        unhealthy = [i for i, ok in enumerate(ray.get([a.health.remote() for a in self.actors])) if not ok]
        if unhealthy:
            raise RuntimeError(f"rollout engine(s) {unhealthy} failed their health check after start-up")

    def __len__(self) -> int:
        return len(self.actors)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Complete ``requests`` on all engines; outputs are in request order."""
        n = len(self.actors)
        bounds = [len(requests) * i // n for i in range(n + 1)]
        futures = [
            actor.generate.remote(requests[lo:hi]) for actor, lo, hi in zip(self.actors, bounds, bounds[1:]) if hi > lo
        ]
        return [out for chunk in ray.get(futures) for out in chunk]

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

    def shutdown(self) -> None:
        ray.get([a.shutdown.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)


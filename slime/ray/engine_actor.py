"""The Ray actor around one rollout engine (:class:`EngineActor`); :mod:`slime.ray.engine_group` starts them.

The actor sets up its process for the engine (log prefix, torch threads, ``CUDA_VISIBLE_DEVICES``),
builds the engine from a picklable factory and forwards every :class:`RolloutEngine` method.  Whatever
processes the engine started and left running are killed when its constructor fails or after its
``shutdown()`` (:func:`slime.utils.processes.kill_descendants`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import ray
import torch

from slime.rollout.engines.base import EngineResources, GenerateOutput, GenerateRequest, RolloutEngine
from slime.utils.processes import kill_descendants


class EngineActor:
    """The Ray actor around one :class:`RolloutEngine` (made remote by :func:`engine_actor_class`);
    methods mirror the engine's.

    ``health``, ``log_tail``, ``memory_info`` and ``shutdown`` run in a concurrency group of their own
    (``"control"``), so they are answered while a ``generate`` call is running; ``generate`` calls run in
    the ``"generate"`` group, ``RolloutEngine.max_concurrent_calls`` at once; every other method runs one
    at a time.
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

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]],
                                   flush_cache: bool = True) -> None:
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

    def abort_requests(self) -> None:  # the default group: runs while generate calls run
        self.engine.abort_requests()

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

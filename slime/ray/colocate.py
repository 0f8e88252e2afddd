"""Memory hand-over between trainers and rollout engines that share GPUs (``--colocate`` on GPU).

Per rollout step, so that optimizer state and KV cache are never on the GPU together::

    train_phase: 1. engines release everything; trainers onload   2. train
                 3. trainers offload all but the policy weights
    sync_phase:  4. engines resume their weights; the push   5. trainers offload their weights
                 6. engines resume KV cache and CUDA graphs

Peak during the sync: trainer weights + engine weights.  Start-up, the mid-rollout re-sync and the
sources (upstream slime's ``--offload`` loop over SGLang's memory-saver tags): ``docs/design/colocate.md``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from slime.utils.timer import PhaseClock

from slime.rollout.engines.base import GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPES

if TYPE_CHECKING:
    from slime.ray.trainer_group import TrainerGroup
    from slime.ray.engine_group import RolloutEngineGroup

RELEASED_FOR_TRAINING = GPU_MEMORY_TYPES
"""Step 1: every engine memory region."""
RESUMED_FOR_SYNC = (GPU_MEMORY_TYPE_WEIGHTS,)
"""Step 4: what the weight push writes into."""
RESUMED_AFTER_SYNC = tuple(tag for tag in GPU_MEMORY_TYPES if tag != GPU_MEMORY_TYPE_WEIGHTS)
"""Step 6: the rest (KV cache, CUDA graphs)."""


class ColocatedMemory:
    """The hand-over above, as context managers around start-up, training, the sync and a mid-rollout re-sync.

    ``enabled`` False: no calls at all.  ``measure``: record the engines' free GPU memory around each
    release (:meth:`metrics`).  A :meth:`sync_phase` without a preceding release resumes nothing.
    """

    def __init__(self, trainers: TrainerGroup, engines: RolloutEngineGroup, enabled: bool, measure: bool = False):
        self.trainers, self.engines, self.enabled = trainers, engines, enabled
        self.measure = measure and enabled
        self._engines_released = False  # step 1 ran and step 6 has not yet
        self._figures: dict[str, float] = {}

    def _measure(self, key: str) -> None:
        """Free memory of the engines' fullest GPU now, GiB, as metric ``memory/<key>``."""
        if not self.measure:
            return
        infos = [info for info in self.engines.memory_info() if info.get("gpus")]
        if infos:
            self._figures[f"memory/{key}"] = min(info["free_gib"] / info["gpus"] for info in infos)

    def metrics(self) -> dict[str, float]:
        """The figures since the last call, GiB per GPU: ``memory/free_gib_engines_resident`` and ``..._released``."""
        figures, self._figures = self._figures, {}
        return figures

    def _release_engines(self, measure: bool = True) -> None:
        if not self._engines_released:
            if measure:
                self._measure("free_gib_engines_resident")
            self.engines.release_memory_occupation(list(RELEASED_FOR_TRAINING))
            self._engines_released = True
            if measure:
                self._measure("free_gib_engines_released")

    @contextlib.contextmanager
    def startup_phase(self) -> Iterator[None]:
        """Around the trainers' initialisation: engines out first; afterwards only the trainers' weights stay."""
        if self.enabled:
            self._release_engines()
        yield  # the trainers load the model, optimizer and any --load checkpoint
        if self.enabled:
            self.trainers.offload(keep_weights=True)

    @contextlib.contextmanager
    def train_phase(self, clock: PhaseClock | None = None) -> Iterator[None]:
        """Steps 1-3; with ``clock``, their times as its ``engine_release``, ``onload`` and ``offload`` sub-phases."""
        clock = clock or PhaseClock("train")
        if self.enabled:
            with clock("engine_release"):
                self._release_engines()  # 1
            with clock("onload"):
                self.trainers.onload()
        yield  # 2. train
        if self.enabled:
            with clock("offload"):
                self.trainers.offload(keep_weights=True)  # 3

    @contextlib.contextmanager
    def sync_phase(self, clock: PhaseClock | None = None) -> Iterator[None]:
        """Steps 4-6; with ``clock``, their times as its ``engine_resume`` (4 and 6) and ``offload`` (5) sub-phases."""
        clock = clock or PhaseClock("sync")
        resume = self._engines_released  # only ever set when enabled
        if resume:
            with clock("engine_resume"):
                self.engines.resume_memory_occupation(list(RESUMED_FOR_SYNC))  # 4
        yield  # 4. push the weights
        if self.enabled:
            with clock("offload"):
                self.trainers.offload()  # 5
        if resume:
            with clock("engine_resume"):
                self.engines.resume_memory_occupation(list(RESUMED_AFTER_SYNC))  # 6
            self._engines_released = False

    @contextlib.contextmanager
    def resync_phase(self) -> Iterator[None]:
        """Around a push mid-rollout: step 1, the trainers' weights only in, then steps 4-6; nothing is measured."""
        if self.enabled:
            self._release_engines(measure=False)  # 1
            self.trainers.onload(weights_only=True)  # the state step 3 leaves
        with self.sync_phase():  # 4-6
            yield

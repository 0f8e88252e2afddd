"""Memory hand-over between trainers and rollout engines that share GPUs (``--colocate`` on GPU).

Trainers and engines take turns on the same GPUs.  One rollout step hands the memory over in
this order, so that the trainer's optimizer state and the engines' KV cache are never on the GPU
together::

    ColocatedMemory.train_phase
      1. engines release all their memory (weights, KV cache, CUDA graphs);
         trainers onload (weights + optimizer state)
      2. train
      3. trainers offload what the weight sync does not read (optimizer state, gradients,
         reference model); the policy weights stay on the GPU
    ColocatedMemory.sync_phase
      4. engines resume their weights only; trainers push the weights into them
      5. trainers offload their weights
      6. engines resume the KV cache and CUDA graphs, ready to generate

At start-up (:meth:`ColocatedMemory.startup_phase`) the engines, which load the checkpoint
when created, release everything before the trainers load the model and optimizer (as upstream
slime offloads the rollout engines right after creating them); after loading, the trainers keep
only their weights (step 3) and the first sync runs steps 4-6.

Mid-rollout re-sync (:meth:`ColocatedMemory.resync_phase`, when a restarted engine needs the
current weights because no other engine is left to serve, see :mod:`slime.rollout.scheduler`):
during a rollout the engines hold everything and the trainers nothing (after step 6), so the re-sync
runs step 1, then the trainers onload their weights only (``onload(weights_only=True)``: the optimizer
state, gradient buffers and reference model stay on the CPU), then steps 4-6 around the push, and
leaves the same state for the rest of the rollout.  Its peak is the sync's: trainer weights + engine
weights.  The trainers record its free-memory figures under ``perf/resync_free_gib_*``, apart from the
training phase's ``perf/train_free_gib_*`` (:meth:`slime.backends.base.TrainerBackend.offload`); the
engines' figures (``memory/free_gib_engines_*``) are not re-measured.

Peak during the sync: trainer weights + engine weights.  (The order this replaces resumed the
engines' weights *and* KV cache while the trainer still held weights and optimizer state.)

Sources: the engine side is upstream slime's train loop (THUDM/slime ``train.py`` with
``--offload``: ``rollout_manager.offload()`` before training;
``onload(tags=[GPU_MEMORY_TYPE_WEIGHTS])``, then ``actor_model.update_weights()``, then
``onload(tags=[GPU_MEMORY_TYPE_KV_CACHE])`` and ``[GPU_MEMORY_TYPE_CUDA_GRAPH]``), over SGLang's
memory-saver tags (``POST /release_memory_occupation`` / ``/resume_memory_occupation`` with
``{"tags": [...]}``, tag strings from ``sglang.srt.constants``; see
:mod:`slime.rollout.engines.base`).  On the trainer side the weights stay on the GPU through the
push because the backends gather the full tensors of the sync from their GPU shards
(:meth:`slime.backends.base.TrainerBackend.offload` with ``keep_weights=True``).

Engines release the tags by name rather than with ``tags=None`` (SGLang: all of its tags, which
in newer versions include ones this interface does not name, e.g. ``weights_drafter``) so that
steps 4 and 6 resume exactly what step 1 released: SGLang refuses to resume a tag that is not
released.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

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
    """The hand-over above, as two context managers around training and the weight sync.

    Args:
        trainers: the trainer group (``onload(weights_only=...)``, ``offload(keep_weights=...)``).
        engines: the engine group (``release_memory_occupation(tags)``,
            ``resume_memory_occupation(tags)``).
        enabled: whether trainers and engines share GPUs; when False both phases make no calls.
        measure: record the engines' free GPU memory before and after each release (:meth:`metrics`).

    :meth:`startup_phase` wraps the trainers' initialisation; a :meth:`sync_phase` without a
    preceding release (e.g. with a start-up that did not use :meth:`startup_phase`) resumes
    nothing and only offloads the trainers afterwards.
    """

    def __init__(self, trainers: TrainerGroup, engines: RolloutEngineGroup, enabled: bool, measure: bool = False):
        self.trainers, self.engines, self.enabled = trainers, engines, enabled
        self.measure = measure and enabled
        self._engines_released = False  # step 1 ran and step 6 has not yet
        self._figures: dict[str, float] = {}

    def _measure(self, key: str) -> None:
        """Free memory of the engines' GPUs now (the fullest GPU), GiB, as metric ``memory/<key>``."""
        if not self.measure:
            return
        infos = [info for info in self.engines.memory_info() if info.get("gpus")]
        if infos:
            self._figures[f"memory/{key}"] = min(info["free_gib"] / info["gpus"] for info in infos)

    def metrics(self) -> dict[str, float]:
        """The figures measured since the last call (``--colocate`` on GPUs): ``memory/free_gib_engines_resident``
        (free GPU memory with the engines' memory in place: what training would get without release) and
        ``memory/free_gib_engines_released`` (after the release: what training gets), GiB per GPU."""
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
        """Around the trainers' initialisation: engines out first; afterwards only the
        trainers' weights stay (step 3), ready for the first :meth:`sync_phase`."""
        if self.enabled:
            self._release_engines()
        yield  # the trainers load the model, optimizer and any --load checkpoint
        if self.enabled:
            self.trainers.offload(keep_weights=True)

    @contextlib.contextmanager
    def train_phase(self) -> Iterator[None]:
        """Steps 1-3: engines out, trainers in; after training only the trainers' weights stay."""
        if self.enabled:
            self._release_engines()  # 1
            self.trainers.onload()
        yield  # 2. train
        if self.enabled:
            self.trainers.offload(keep_weights=True)  # 3

    @contextlib.contextmanager
    def sync_phase(self) -> Iterator[None]:
        """Steps 4-6: engine weights in, weights pushed, trainers out, engine KV cache in."""
        resume = self._engines_released  # only ever set when enabled
        if resume:
            self.engines.resume_memory_occupation(list(RESUMED_FOR_SYNC))  # 4
        yield  # 4. push the weights
        if self.enabled:
            self.trainers.offload()  # 5
        if resume:
            self.engines.resume_memory_occupation(list(RESUMED_AFTER_SYNC))  # 6
            self._engines_released = False

    @contextlib.contextmanager
    def resync_phase(self) -> Iterator[None]:
        """Around a weight push in the middle of a rollout (engines resident, trainers offloaded): step 1
        (engines out), the trainers' weights in (``onload(weights_only=True)``: what step 3 would keep,
        without moving the optimizer state to the GPU and back), then :meth:`sync_phase` (steps 4-6), so
        the engines hold everything again afterwards.

        Nothing is measured here: :meth:`metrics` keeps the figures of the step's own :meth:`train_phase`
        (the trainers record theirs as ``perf/resync_free_gib_*``).
        """
        if self.enabled:
            self._release_engines(measure=False)  # 1
            self.trainers.onload(weights_only=True)  # the state step 3 leaves
        with self.sync_phase():  # 4-6
            yield

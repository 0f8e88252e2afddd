"""A trainer rank's half of the colocated memory hand-over (``--colocate`` on GPU): what it moves off and onto its
device, in which order, and the free-memory figures of each move.

A backend holds one :class:`HandOver` (``backend.memory``) and supplies the moves themselves
(``move_part(part, onto_device)``: FSDP moves modules and AdamW's state, Megatron megatron-core's buffers).  The
driver's side, the engines' release and resume around the trainers' moves, is :class:`slime.driver.ColocatedMemory`; the call
order: ``docs/design/colocate.md``.
"""

from __future__ import annotations

import logging

import torch

from slime.utils.timer import synchronize_current_stream

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""The policy's parameters, what :meth:`HandOver.onload` with ``weights_only`` brings back (the weight sync and the
engine parity check read them)."""
TRAINING_STATE = "training_state"
"""What only the optimizer step needs: optimizer state (fp32 main weights, Adam moments), gradient buffers, the
reference model."""


class HandOver:
    """Which parts of ``owner`` (a backend: its ``model``, ``device`` and ``move_part``) are off the device, the moves
    that change it, and their figures.  Every method is collective where the owner's moves are.

    Nothing moves before the owner's ``model`` exists (before ``init``); on a CPU device the parts are tracked but
    not moved, and nothing is measured.
    """

    def __init__(self, owner):
        self.owner = owner
        self.offloaded: frozenset[str] = frozenset()  # the parts (WEIGHTS, TRAINING_STATE) now off the device
        self._figure_phase = "train"  # the name offload figures go under: that of the last onload (see offload)
        self._figures: dict[str, float] | None = None  # recorded since the last metrics()

    def offload(self, keep_weights: bool = False) -> None:
        """Move this rank's training memory off the GPU for colocated engines: :data:`TRAINING_STATE`, then (unless
        ``keep_weights``) :data:`WEIGHTS`, each only if it is on the device.  On CUDA records
        ``perf/<phase>_free_gib_{before,after}_offload[_keep_weights]`` (GiB; ``<phase>``: ``resync`` after
        ``onload(weights_only=True)``, else ``train``)."""
        name = "offload_keep_weights" if keep_weights else "offload"
        self._move([TRAINING_STATE] if keep_weights else [TRAINING_STATE, WEIGHTS], False,
                   f"{self._figure_phase}_free_gib", name)

    def onload(self, weights_only: bool = False) -> None:
        """Undo :meth:`offload`, weights first; ``weights_only``: :data:`WEIGHTS` alone, enough for the weight sync
        and the engine parity check.  Records ``perf/train_free_gib_{before,after}_onload`` (or
        ``perf/resync_free_gib_{before,after}_onload_weights``)."""
        self._figure_phase = "resync" if weights_only else "train"
        self._move([WEIGHTS] if weights_only else [WEIGHTS, TRAINING_STATE], True,
                   f"{self._figure_phase}_free_gib", "onload_weights" if weights_only else "onload")

    def metrics(self) -> dict[str, float]:
        """The free-memory figures (GiB) recorded since the last call, then forgotten, so that each move is in one
        step's metrics; ``{}`` on CPU."""
        figures, self._figures = self._figures or {}, None
        return figures

    def begin_step(self) -> dict[str, float]:
        """At the start of a training step: :meth:`require` (``train()``, the optimizer state too), then
        :meth:`metrics`, the figures of the moves since the last step (none moves during one)."""
        self.require("train()", training=True)
        return self.metrics()

    def require_init(self) -> None:
        """Raise ``RuntimeError`` before the owner's ``init`` built its model."""
        if self.owner.model is None:
            raise RuntimeError(f"{type(self.owner).__name__}.init() must run before train / compute_log_probs / "
                               "save / weight sync")

    def require(self, what: str, *, training: bool) -> None:
        """Raise ``RuntimeError`` before the owner's ``init`` (:meth:`require_init`), or (naming ``what`` and the
        missing :meth:`onload`) unless the weights, and with ``training`` the optimizer state too, are on the
        device."""
        self.require_init()
        missing = self.offloaded if training else self.offloaded & {WEIGHTS}
        if missing:
            call = "onload()" if training else "onload() or onload(weights_only=True)"
            raise RuntimeError(f"{what} needs this rank's {' and '.join(sorted(missing))} on the device, but "
                               f"offload() moved them off: call {call} first")

    def _move(self, parts: list[str], onto_device: bool, prefix: str, move: str) -> None:
        """Move ``parts`` (in order) onto or off the device where they are not there yet; on CUDA the figures
        ``perf/<prefix>_{before,after}_<move>``."""
        if self.owner.model is None:
            return
        moving = [part for part in parts if (part in self.offloaded) == onto_device]
        if not moving:
            return
        device = self.owner.device
        on_gpu = device.type == "cuda"
        before = free_gib(device) if on_gpu else 0.0
        for part in moving:
            if on_gpu:
                self.owner.move_part(part, onto_device)
            self.offloaded = self.offloaded - {part} if onto_device else self.offloaded | {part}
        if not on_gpu:
            return
        synchronize_current_stream(device)  # a background onload's copies (HostParking.restore) may still run
        if not onto_device:
            torch.cuda.empty_cache()
        after = free_gib(device)
        if self._figures is None:
            self._figures = {}
        self._figures[f"perf/{prefix}_before_{move}"] = before
        self._figures[f"perf/{prefix}_after_{move}"] = after
        logger.info("%s (%s): free GPU memory %.2f -> %.2f GiB", move, ", ".join(moving), before, after)


def free_gib(device: torch.device) -> float:
    """Free memory of ``device`` as the driver reports it (``cudaMemGetInfo``), GiB."""
    free, _ = torch.cuda.mem_get_info(device)
    return free / float(1 << 30)

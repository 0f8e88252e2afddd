"""The training-backend interface: one data-parallel rank of a trainer.

The driver never sees a backend directly: :class:`slime.ray.trainer_group.TrainerGroup`
starts one Ray actor per rank, each holding a :class:`TrainerBackend`, splits every
rollout batch across the data-parallel ranks, and gathers the metrics.  Two backends
exist, selected with ``--train-backend``:

- ``fsdp``: the Hugging Face ``Qwen3_5MoeForConditionalGeneration`` wrapped with torch
  FSDP2 (``fully_shard``); gloo on CPU, NCCL on GPU.
- ``megatron``: slime's native Megatron-core Qwen3.5 language model (Gated DeltaNet +
  gated attention + MoE) with the Hugging Face vision tower, packed micro-batches through
  megatron-core's schedule, its DDP and distributed optimizer
  (:mod:`slime.backends.megatron.backend`; flags and checks in :mod:`slime.backends.megatron.config`).

Both compute the loss with the shared GRPO math (:mod:`slime.grpo.loss`) and export
their weights by Hugging Face parameter name for the weight sync (:mod:`slime.weight_sync`):
each rank yields the tensors it is the source of (:meth:`TrainerBackend.iter_weight_buckets`).
A backend's flags, parse-time checks, data-parallel size and checkpoint layout live in its
:class:`slime.backends.config.BackendConfig` subclass (``slime/backends/<name>/config.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from pathlib import Path
from typing import Iterator

import torch

from slime.data.sample import Sample

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""Colocated memory: the policy's parameters, what :meth:`TrainerBackend.onload` with ``weights_only`` brings back
(the weight sync and :meth:`TrainerBackend.compute_log_probs` read them)."""
TRAINING_STATE = "training_state"
"""Colocated memory: what only the optimizer step needs: optimizer state (fp32 main weights, Adam moments),
gradient buffers, the reference model."""


@dataclasses.dataclass
class RankInfo:
    """Where this rank sits in the trainer world.

    Attributes:
        rank: global rank in the trainer process group, 0 <= rank < world_size.
        world_size: number of trainer processes.
        master_addr: address of rank 0 for ``torch.distributed`` rendezvous.
        master_port: TCP port of that rendezvous.
        device: ``"cuda"`` or ``"cpu"``; the process group uses NCCL or gloo accordingly.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str


class TrainerBackend(abc.ABC):
    """One rank of a training backend. Every method is collective: the group calls it on all ranks.

    Batches arrive already split by data-parallel rank: ``samples`` holds this rank's share
    of every optimizer step of the rollout, in order (``num_steps`` consecutive chunks of
    equal size ``global_batch_size / dp_size``).
    """

    @abc.abstractmethod
    def init(self) -> int:
        """Build the model, optimizer and (if a KL coefficient is set) the reference model.

        Loads ``--load`` when given.

        Returns:
            The next rollout id to train: 0 for a fresh run, ``k + 1`` after loading the
            checkpoint of rollout ``k``.
        """

    @abc.abstractmethod
    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """Run ``num_steps`` optimizer steps over this rank's samples.

        Args:
            rollout_id: the rollout step, for logs and schedulers.
            samples: this rank's samples, with rewards, advantages and rollout log-probs.
            num_steps: optimizer steps; ``len(samples)`` is a multiple of it.

        Returns:
            Metrics averaged over the steps (already reduced across ranks, so every rank
            returns the same values): ``train/loss``, ``train/pg_loss``,
            ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/kl_loss``, ``train/entropy``,
            ``train/grad_norm``, ``train/lr``, and the train-vs-rollout log-prob gap
            ``train/logprob_abs_diff`` split into ``..._image`` and ``..._text`` prompts.
        """

    @abc.abstractmethod
    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False) -> list[list[float]]:
        """Per-token log-probs of each sample's response under the current policy.

        Uses ``logits / --rollout-temperature``, as the engines do, with the sample's
        ``pixel_values`` / ``image_grid_thw``.  Not part of the training loop (``train`` computes
        its own old log-probs): this is the entry point of the engine parity check, which
        compares the trainer's log-probs of a fixed prompt and response with an engine's
        (:meth:`slime.ray.trainer_group.TrainerGroup.compute_log_probs`; ``tests/test_weight_sync.py``
        and the SGLang engine's parity check).  Collective; every rank passes the same samples.

        With ``rounding_noise`` the token embeddings get one rounding step of noise
        (:func:`slime.backends.rounding.rounding_step_noise`): the difference to the plain call is this
        trainer's own numerical floor on these tokens, which the parity check judges the engine against.

        Returns:
            One list of R floats (nats) per sample.
        """

    @abc.abstractmethod
    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's share of the full weights, by Hugging Face checkpoint name, for the weight sync.

        The contract every backend keeps (:mod:`slime.weight_sync.base`):

        - a rank yields only the tensors it is the **source** of, whole (unsharded) and already
          under their Hugging Face checkpoint names (fused in-memory layouts converted back, the
          vision tower under its HF names); a tensor-parallel shard is gathered within its TP
          group and yielded by one rank of it; pipeline stages and expert-parallel ranks each
          yield their own layers and experts; the union over all ranks is the whole model, each
          name exactly once;
        - collective and in lockstep: every rank must exhaust the iterator, and every rank yields
          the same number of buckets, bucket ``k`` of each rank being its share of round ``k``
          (``[]`` on a rank that is not a source in that round), so a transport may run its own
          collectives between buckets;
        - a bucket holds whole layers, about ``bucket_bytes`` bytes (one layer larger than that is
          a bucket of its own).

        Args:
            bucket_bytes: target bucket size, bytes (``--update-weight-buffer-size``), > 0.
            device: where the yielded tensors live: ``"cpu"`` (the object store), or ``None`` for
                this rank's device (IPC / NCCL transports).  Dtype: the backend's compute dtype.

        Raises:
            ValueError: ``bucket_bytes <= 0``.
        """

    @abc.abstractmethod
    def save(self, rollout_id: int, path: Path) -> None:
        """Write this backend's checkpoint of ``rollout_id`` into the iteration folder ``path``. Collective.

        What a complete checkpoint holds is the backend's to say
        (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`); the driver adds
        ``rollout_state.pt`` and marks the checkpoint complete (:mod:`slime.checkpoints.layout`).
        """

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """This rank's (data-parallel rank, data-parallel size).

        The default suits pure data parallelism (FSDP): every rank is its own
        data-parallel rank. Backends with tensor/pipeline/context parallelism override it
        so that peers of one model replica receive the same samples.
        """
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    # ------------------------------------------------------------------------------------
    # colocated memory (--colocate on GPU): the hand-over logic, once for every backend
    # ------------------------------------------------------------------------------------

    device: torch.device = torch.device("cpu")
    """This rank's device; the backend sets it in :meth:`init`.  Only a CUDA device moves memory."""
    model: torch.nn.Module | None = None
    """The policy module (None before :meth:`init`): nothing moves before the model exists."""
    _offloaded: frozenset[str] = frozenset()  # the parts (WEIGHTS, TRAINING_STATE) now off the device
    _figure_phase: str = "train"  # the name offload figures go under: that of the last onload (see offload)
    _memory_figures: dict[str, float] | None = None  # recorded since the last memory_metrics()

    def offload(self, keep_weights: bool = False) -> None:
        """Move this rank's training memory off the GPU for colocated engines. Collective.

        Two parts move, each only if it is on the device (:data:`TRAINING_STATE` first, then
        :data:`WEIGHTS`), so calling it twice, or after :meth:`onload` with ``weights_only``, moves
        only what is still there.  The backend's :meth:`_move_part` moves them; on CPU (or before
        :meth:`init`) nothing moves, but which parts are "offloaded" is tracked all the same (after
        :meth:`init`), so :meth:`_require_on_device` guards the same call orders on every device.

        Args:
            keep_weights: keep the policy weights on the GPU, where :meth:`iter_weight_buckets`
                gathers them for the weight sync, and move everything else (optimizer state,
                gradients, a reference model); ``False`` moves everything.

        Records (on a CUDA device, when something moved) the device's free memory before and after,
        GiB (``cudaMemGetInfo``), as ``perf/<phase>_free_gib_{before,after}_offload`` (``..._offload_keep_weights``
        with ``keep_weights``), where ``<phase>`` is ``resync`` after an ``onload(weights_only=True)`` (the
        offload ends a mid-rollout re-sync) and ``train`` otherwise (after a full :meth:`onload`, or at
        start-up).  :meth:`memory_metrics` hands them to the next :meth:`train`'s metrics.

        :class:`slime.ray.colocate.ColocatedMemory` calls ``offload(keep_weights=True)`` after training
        (and at start-up) and ``offload()`` after each weight sync.
        """
        name = "offload_keep_weights" if keep_weights else "offload"
        self._hand_over([TRAINING_STATE] if keep_weights else [TRAINING_STATE, WEIGHTS], False,
                        f"{self._figure_phase}_free_gib", name)

    def onload(self, weights_only: bool = False) -> None:
        """Undo :meth:`offload`. Collective.

        Args:
            weights_only: bring back the policy weights alone (:data:`WEIGHTS`), enough for
                :meth:`iter_weight_buckets` and :meth:`compute_log_probs`, and leave the optimizer
                state, gradient buffers and reference model (:data:`TRAINING_STATE`; with AdamW the
                fp32 moments alone are twice the parameters) off the GPU: the mid-rollout re-sync
                (:meth:`slime.ray.colocate.ColocatedMemory.resync_phase`).  ``False`` brings back
                everything, ready to :meth:`train` (weights first, then the rest; a part already on the
                device is not moved again), and is what every :meth:`train` after an offload needs.

        Records (on a CUDA device, when something moved) ``perf/train_free_gib_{before,after}_onload``, or
        with ``weights_only`` ``perf/resync_free_gib_{before,after}_onload_weights`` (GiB).
        """
        self._figure_phase = "resync" if weights_only else "train"
        self._hand_over([WEIGHTS] if weights_only else [WEIGHTS, TRAINING_STATE], True,
                        f"{self._figure_phase}_free_gib", "onload_weights" if weights_only else "onload")

    def memory_metrics(self) -> dict[str, float]:
        """The free-memory figures (GiB) recorded by :meth:`offload` / :meth:`onload` since the last call, and
        forgets them: each backend's :meth:`train` adds them to its metrics, so a rollout step's record holds
        the moves since the previous step's training (that step's offloads after training and after the
        sync, or the start-up's; a mid-rollout re-sync's; this step's onload), each once.  ``{}`` on CPU."""
        figures, self._memory_figures = self._memory_figures or {}, None
        return figures

    def _hand_over(self, parts: list[str], onto_device: bool, prefix: str, move: str) -> None:
        """Move ``parts`` (in order) onto or off the device where they are not there yet (nothing before
        :meth:`init`); on CUDA the figures ``perf/<prefix>_{before,after}_<move>``."""
        if self.model is None:
            return
        moving = [part for part in parts if (part in self._offloaded) == onto_device]
        if not moving:
            return
        on_gpu = self.device.type == "cuda"
        before = _free_gib(self.device) if on_gpu else 0.0
        for part in moving:
            if on_gpu:
                self._move_part(part, onto_device)
            self._offloaded = self._offloaded - {part} if onto_device else self._offloaded | {part}
        if not on_gpu:
            return
        torch.cuda.synchronize(self.device)
        if not onto_device:
            torch.cuda.empty_cache()
        after = _free_gib(self.device)
        if self._memory_figures is None:
            self._memory_figures = {}
        self._memory_figures[f"perf/{prefix}_before_{move}"] = before
        self._memory_figures[f"perf/{prefix}_after_{move}"] = after
        logger.info("%s (%s): free GPU memory %.2f -> %.2f GiB", move, ", ".join(moving), before, after)

    def _move_part(self, part: str, onto_device: bool) -> None:
        """Move one part of this rank's training memory onto (``onto_device``) or off its CUDA device.

        Called only on CUDA after :meth:`init`, once per part and direction (:meth:`offload` /
        :meth:`onload` keep track).  Backends that offload implement it:

        - :data:`WEIGHTS`: the policy's parameters as the forward pass and the weight export read them;
        - :data:`TRAINING_STATE`: what only the optimizer step needs: optimizer state (fp32 main weights,
          Adam moments), gradient buffers, the reference model.

        The default moves nothing (a backend that keeps everything on the device).
        """

    def _require_on_device(self, what: str, *, training: bool) -> None:
        """Raise unless this rank's weights (and with ``training`` its optimizer state too) are on the
        device, i.e. unless :meth:`onload` (``weights_only`` is enough without ``training``) followed
        the last :meth:`offload`.

        Raises:
            RuntimeError: naming ``what`` was called and the missing :meth:`onload`.
        """
        missing = self._offloaded if training else self._offloaded & {WEIGHTS}
        if missing:
            call = "onload()" if training else "onload() or onload(weights_only=True)"
            raise RuntimeError(f"{what} needs this rank's {' and '.join(sorted(missing))} on the device, but "
                               f"offload() moved them off: call {call} first")


def _free_gib(device: torch.device) -> float:
    """Free memory of ``device`` as the driver reports it (``cudaMemGetInfo``), GiB."""
    free, _ = torch.cuda.mem_get_info(device)
    return free / float(1 << 30)

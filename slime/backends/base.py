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

Both compute the loss with the shared GRPO math (:mod:`slime.utils.ppo_utils`) and export
their weights by Hugging Face parameter name for the weight sync (:mod:`slime.weight_sync`):
each rank yields the tensors it is the source of (:meth:`TrainerBackend.iter_weight_buckets`).
A backend's flags, parse-time checks, data-parallel size and checkpoint layout live in its
:class:`slime.backends.config.BackendConfig` subclass (``slime/backends/<name>/config.py``).
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Iterator

import torch

from slime.utils.types import Sample


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
    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-token log-probs of each sample's response under the current policy.

        Uses ``logits / --rollout-temperature``, as the engines do, with the sample's
        ``pixel_values`` / ``image_grid_thw``.  Not part of the training loop (``train`` computes
        its own old log-probs): this is the entry point of the engine parity check, which
        compares the trainer's log-probs of a fixed prompt and response with an engine's
        (:meth:`slime.ray.trainer_group.TrainerGroup.compute_log_probs`; ``tests/test_weight_sync.py``
        and the SGLang engine's parity check).  Collective; every rank passes the same samples.

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
        ``rollout_state.pt`` and marks the checkpoint complete (:mod:`slime.utils.checkpoint`).
        """

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """This rank's (data-parallel rank, data-parallel size).

        The default suits pure data parallelism (FSDP): every rank is its own
        data-parallel rank. Backends with tensor/pipeline/context parallelism override it
        so that peers of one model replica receive the same samples.
        """
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def offload(self, keep_weights: bool = False) -> None:
        """Move this rank's training memory off the GPU for colocated engines. No-op on CPU.

        Args:
            keep_weights: keep the policy weights on the GPU, where :meth:`iter_weight_buckets`
                gathers them for the weight sync, and move everything else (optimizer state,
                gradients, a reference model); ``False`` moves everything.  Calling it again
                with ``False`` moves the rest.

        Collective.  :class:`slime.ray.colocate.ColocatedMemory` calls ``offload(keep_weights=True)``
        after training and ``offload()`` after the weight sync.
        """

    def onload(self) -> None:
        """Undo :meth:`offload` (everything back on the GPU, ready to train). Collective."""

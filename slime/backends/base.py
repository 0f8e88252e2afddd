"""The training-backend interface: one data-parallel rank of a trainer.

The driver never sees a backend directly: :class:`slime.ray.trainer_group.TrainerGroup`
starts one Ray actor per rank, each holding a :class:`TrainerBackend`, splits every
rollout batch across the data-parallel ranks, and gathers the metrics.  Two backends
exist, selected with ``--train-backend``:

- ``fsdp``: the Hugging Face ``Qwen3_5MoeForConditionalGeneration`` wrapped with torch
  FSDP2 (``fully_shard``); gloo on CPU, NCCL on GPU.
- ``megatron``: slime's native Megatron-core Qwen3.5 language model (Gated DeltaNet +
  gated attention + MoE) with the Hugging Face vision tower.

Both compute the loss with the shared GRPO math (:mod:`slime.utils.ppo_utils`) and push
weights to the rollout engines by Hugging Face parameter name.
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
        ``pixel_values`` / ``image_grid_thw``.

        Returns:
            One list of R floats (nats) per sample.
        """

    @abc.abstractmethod
    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights by Hugging Face name, in buckets of about ``bucket_bytes``.

        Collective (gathers shards); only rank 0 yields buckets, other ranks yield nothing
        but must still exhaust the iterator.
        """

    @abc.abstractmethod
    def save(self, rollout_id: int, path: Path) -> None:
        """Write model (HF safetensors), optimizer and scheduler state under ``path``."""

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

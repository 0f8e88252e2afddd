"""The training-backend interface, and the training step written once.

One :class:`TrainerBackend` per trainer rank; :class:`slime.ray.trainer_group.TrainerGroup` runs one Ray
actor per rank, splits every rollout batch across the data-parallel ranks and gathers the metrics.  Two
backends exist (``--train-backend``): ``fsdp`` (the Hugging Face model under torch FSDP2) and
``megatron`` (the native Megatron-core Qwen3.5 model and megatron-core's schedule).

:meth:`TrainerBackend.train` is the training step of every backend: it checks the samples, cuts them into
optimizer steps and micro-batches (:mod:`slime.backends.steps`), takes the old and reference log-probs and
the train-vs-rollout log-prob gap (:mod:`slime.backends.train_metrics`), and runs each optimizer step
(loss normaliser, learning rate of :class:`slime.backends.lr_schedule.LRSchedule`, gradient-norm check,
``--clip-grad``, metric sums).  A backend supplies the hooks that differ: :meth:`~TrainerBackend._pack`,
:meth:`~TrainerBackend._forward_log_probs`, :meth:`~TrainerBackend._forward_backward`,
:meth:`~TrainerBackend._grad_norm`, :meth:`~TrainerBackend._apply_update`,
:meth:`~TrainerBackend._placeholder_ids`, :meth:`~TrainerBackend._input_embedding`,
:meth:`~TrainerBackend._route_shape` (routing replay) and :meth:`~TrainerBackend._move_part` (colocated memory).
Why the cut is there: ``docs/design/training_step.md``.

Weights leave by Hugging Face name (:meth:`TrainerBackend.iter_weight_buckets`, :mod:`slime.weight_sync`);
a backend's flags, checks and checkpoint layout live in its :class:`slime.backends.config.BackendConfig`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.lr_schedule import LRSchedule
from slime.backends.rounding import rounding_step_noise
from slime.backends.steps import check_train_samples, loss_normalizer, plan_micro_batches, split_into_steps
from slime.backends.train_metrics import all_reduce_sums, logprob_gap_metrics, logprob_gap_sums
from slime.data.routes import RouteShape
from slime.data.sample import Sample

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""Colocated memory: the policy's parameters, what :meth:`TrainerBackend.onload` with ``weights_only`` brings back
(the weight sync and :meth:`TrainerBackend.compute_log_probs` read them)."""
TRAINING_STATE = "training_state"
"""Colocated memory: what only the optimizer step needs: optimizer state (fp32 main weights, Adam moments),
gradient buffers, the reference model."""


class NonFiniteGradNorm(FloatingPointError):
    """The global gradient norm is NaN or infinite; no update was applied."""


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


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as the skeleton hands it to the hooks.

    Attributes:
        indices: its samples' positions in the list given to :meth:`TrainerBackend.train` (or
            :meth:`~TrainerBackend.compute_log_probs`).
        samples: those samples, in order.
        packed: what the backend's :meth:`~TrainerBackend._pack` made of them (None by default).
        old_log_probs, ref_log_probs: per sample, float32 ``[R_s]`` on the CPU, set before the first update
            (None before, for the reference without a KL term, and on ranks that compute no loss).
    """

    indices: list[int]
    samples: list[Sample]
    packed: Any = None
    old_log_probs: list[Tensor] | None = None
    ref_log_probs: list[Tensor] | None = None


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor ``--clip-grad`` scales every gradient by: ``min(1, max_norm / (grad_norm + 1e-6))``, in
    float32 as ``torch.nn.utils.clip_grad_norm_`` computes it; 1.0 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return float(torch.clamp(max_norm / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6), max=1.0))


class TrainerBackend(abc.ABC):
    """One rank of a training backend. Every public method is collective: the group calls it on all ranks.

    Batches arrive already split by data-parallel rank: ``samples`` holds this rank's share of every
    optimizer step of the rollout, in order (``num_steps`` consecutive chunks of equal size
    ``global_batch_size / dp_size``).

    Args:
        rank_info: this rank's place in the trainer world.
        train: BACKEND_ARGS (micro-batching, ``--bf16``, ``--use-rollout-logprobs``: the engines' log-probs
            as the PPO ratio's old log-probs, in which case ``train/logprob_abs_diff*`` are not reported).
        optimizer: OPTIMIZER_ARGS (AdamW, ``--clip-grad`` and the LR schedule).
        grpo: the GRPO loss flags; ``grpo.needs_ref_model`` decides the reference model.
        checkpoint: CKPT_ARGS (resolved by :func:`slime.backends.weight_sources.resolve_weights`).
        rollout_temperature: ``--rollout-temperature`` (> 0); log-probs are taken under
            ``softmax(logits / rollout_temperature)``, as the engines sample.
        num_rollout: rollout steps of the run, or None when unknown (then a decaying LR schedule needs
            ``--lr-decay-iters``).
        num_steps_per_rollout: optimizer steps per rollout; with ``num_rollout`` the default decay length.
        seed: base seed; rank ``r`` seeds torch with ``seed + r``.

    Raises:
        ValueError: ``num_steps_per_rollout < 1``.
        ConfigError: an inconsistent LR schedule (see :class:`LRSchedule`).
    """

    config_group: ClassVar[str] = ""
    """The backend's own flag group in the run's config (``"fsdp"``, ``"megatron"``), for :meth:`from_config`."""

    def __init__(self, rank_info: RankInfo, *, train, optimizer, grpo, checkpoint, rollout_temperature: float,
                 num_rollout: int | None, num_steps_per_rollout: int, seed: int = 0):
        if num_steps_per_rollout < 1:
            raise ValueError(f"num_steps_per_rollout must be >= 1, got {num_steps_per_rollout}")
        self.rank_info = rank_info
        self.train_cfg, self.optim_cfg, self.grpo, self.ckpt_cfg = train, optimizer, grpo, checkpoint
        self.temperature = rollout_temperature
        self.seed = seed
        total = None if num_rollout is None else num_rollout * num_steps_per_rollout
        self.lr_schedule = LRSchedule.from_config(optimizer, total)
        self.optimizer_steps = 0
        self.device = torch.device("cpu")
        self.model = self.ref_model = self.optimizer = None

    @classmethod
    def from_config(cls, cfg, rank_info: RankInfo) -> "TrainerBackend":
        """Build from the run's :class:`slime.arguments.SlimeConfig` (what the trainer group calls)."""
        return cls(
            rank_info, **{cls.config_group: getattr(cfg, cls.config_group)}, train=cfg.train,
            optimizer=cfg.optimizer, grpo=cfg.grpo, checkpoint=cfg.checkpoint,
            rollout_temperature=cfg.rollout.rollout_temperature, num_rollout=cfg.rollout.num_rollout,
            num_steps_per_rollout=cfg.steps_per_rollout,
            seed=cfg.cluster.seed,
        )

    @abc.abstractmethod
    def init(self) -> int:
        """Build the model, optimizer and (if a KL coefficient is set) the reference model, from the weights
        :func:`slime.backends.weight_sources.resolve_weights` names.

        Returns:
            The next rollout id to train: 0 for a fresh run, ``k + 1`` after loading the checkpoint of rollout ``k``.
        """

    # ------------------------------------------------------------------------------------
    # the training step
    # ------------------------------------------------------------------------------------

    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """Run ``num_steps`` optimizer steps over this rank's samples (module docstring).

        Args:
            rollout_id: the rollout step, for logs and errors.
            samples: this rank's samples, with advantages and rollout log-probs.
            num_steps: optimizer steps; ``len(samples)`` is a multiple of it.

        Returns:
            Metrics averaged over the steps, identical on every rank: ``train/loss``, ``train/pg_loss``,
            ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/entropy``, ``train/kl_loss`` (with a KL loss),
            ``train/grad_norm`` (before clipping), ``train/lr``, the backend's own (:meth:`_step_metrics`),
            the log-prob gap ``train/logprob_abs_diff`` with ``_image`` / ``_text`` splits (a split without
            tokens omitted) and ``train/logprob_gap_altered_tokens`` (unless ``--use-rollout-logprobs``), and
            colocated on GPU the free-memory figures of :meth:`memory_metrics`.

        Raises:
            SampleError: a malformed sample on any rank, or a missing ``rollout_log_probs`` with
                ``--use-rollout-logprobs``.
            ValueError: ``len(samples)`` is not a positive multiple of ``num_steps``.
            NonFiniteGradNorm: the gradient norm is not finite (no update applied).
            RuntimeError: before :meth:`init`, or the optimizer state is offloaded (no :meth:`onload`).
        """
        self._require_init()
        self._require_on_device("train()", training=True)
        check_train_samples(samples, need_rollout_log_probs=self.train_cfg.use_rollout_logprobs)
        steps = [self._micro_batches(samples, indices, self._dp_group())
                 for indices in split_into_steps(range(len(samples)), num_steps)]
        everything = [batch for batches in steps for batch in batches]
        gap: dict[str, float] = {}
        if self.train_cfg.use_rollout_logprobs:
            old = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
        else:
            old = self._log_probs_by_sample(self.model, everything, len(samples))
            found = [] if old is None else samples  # ranks that compute no loss add zeros
            sums = logprob_gap_sums(found, old or [], self._placeholder_ids())
            gap = logprob_gap_metrics(self._metric_sum(sums))
        ref = None if self.ref_model is None else self._log_probs_by_sample(self.ref_model, everything, len(samples))
        for batch in everything:
            batch.old_log_probs = None if old is None else [old[i] for i in batch.indices]
            batch.ref_log_probs = None if ref is None else [ref[i] for i in batch.indices]

        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        for batches in steps:
            for name, value in self._optimizer_step(rollout_id, batches).items():
                totals[name] += value
        metrics = {name: value / num_steps for name, value in totals.items()}
        metrics.update(gap)
        metrics.update(self.memory_metrics())
        return metrics

    def _optimizer_step(self, rollout_id: int, batches: list[MicroBatch]) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of it; returns its metrics, reduced over ranks."""
        step_samples = [sample for batch in batches for sample in batch.samples]
        normalizer = loss_normalizer(step_samples, self.grpo.calculate_per_token_loss, group=self._dp_group())
        lr = self.lr_schedule(self.optimizer_steps)
        terms = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy"]
        if self.grpo.use_kl_loss and self.ref_model is not None:
            terms.append("kl_loss")
        sums = {f"train/{name}": 0.0 for name in terms}
        for values in self._forward_backward(batches, normalizer):
            for name in terms:
                sums[f"train/{name}"] += float(values[name].double().cpu())
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm):
            raise NonFiniteGradNorm(
                f"rollout {rollout_id}, optimizer step {self.optimizer_steps}: gradient norm is {grad_norm}; lower "
                "--lr, check the rewards/advantages for NaN, or train in float32 (no --bf16)"
            )
        self._apply_update(lr, clip_coefficient(grad_norm, self.optim_cfg.clip_grad))
        self.optimizer_steps += 1
        return {**self._metric_sum(sums), "train/grad_norm": grad_norm, "train/lr": lr, **self._step_metrics(batches)}

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]] | None:
        """Per-token log-probs (nats) of each sample's response under the current policy (no grad).

        At ``logits / --rollout-temperature``, with the sample's images.  Not part of :meth:`train` (which
        takes its own old log-probs): the trainer side of the engine parity check
        (:meth:`slime.ray.trainer_group.TrainerGroup.compute_log_probs`).  Every rank passes the same samples.
        With ``rounding_noise`` the token embeddings (:meth:`_input_embedding`) get one rounding step of noise
        (:func:`slime.backends.rounding.rounding_step_noise`): the difference to the plain call is this
        trainer's own numerical floor on these tokens, which the parity check judges the engine against.
        With ``replay_routes`` every MoE layer takes each sample's ``rollout_routed_experts`` at positions
        ``0 .. P + R - 2`` (its own choice at the last position and on padding), gate weights from its own
        router logits (:func:`slime.models.routes.forced_gate_weights`).

        Returns:
            One list of R floats per sample; None on a rank that computes no loss (a pipeline stage before
            the last), which a backend with such ranks overrides to share the lists.

        Raises:
            SampleError: a malformed sample on any rank; with ``replay_routes``, a sample without routes or
                with routes of another shape than its prompt, response and the model (naming the sample).
            NotImplementedError: ``replay_routes`` on a model or parallel layout that cannot replay them
                (:meth:`_route_shape`).
        """
        self._require_init()
        self._require_on_device("compute_log_probs()", training=False)
        check_train_samples(samples, routes=self._route_shape() if replay_routes else None)
        batches = self._micro_batches(samples, range(len(samples)), None)
        with rounding_step_noise(self._input_embedding() if rounding_noise else None):
            log_probs = self._log_probs_by_sample(self.model, batches, len(samples), replay_routes=replay_routes)
        return None if log_probs is None else [lp.tolist() for lp in log_probs]

    def _micro_batches(self, samples: Sequence[Sample], indices: Sequence[int], dp_group) -> list[MicroBatch]:
        """``samples[indices]`` planned into micro-batches (:func:`slime.backends.steps.plan_micro_batches`:
        ``--micro-batch-size``, or ``--max-tokens-per-gpu`` bins agreed over ``dp_group``) and packed."""
        chosen = [samples[i] for i in indices]
        max_tokens = self.train_cfg.max_tokens_per_gpu if self.train_cfg.use_dynamic_batch_size else None
        plan = plan_micro_batches(chosen, micro_batch_size=self.train_cfg.micro_batch_size, max_tokens=max_tokens,
                                  dp_group=dp_group)
        batches = []
        for part in plan:
            members = [chosen[j] for j in part]
            batches.append(MicroBatch([indices[j] for j in part], members, self._pack(members)))
        return batches

    def _log_probs_by_sample(self, model, batches: list[MicroBatch], count: int, *,
                             replay_routes: bool = False) -> list[Tensor] | None:
        """:meth:`_forward_log_probs` of ``batches``, as one tensor per sample position ``0 .. count - 1``."""
        found = self._forward_log_probs(model, batches, replay_routes=replay_routes)
        if found is None:
            return None
        out: list[Tensor] = [None] * count  # type: ignore[list-item]
        for i, log_probs in zip((i for batch in batches for i in batch.indices), found, strict=True):
            out[i] = log_probs
        return out

    # ------------------------------------------------------------------------------------
    # the hooks a backend supplies
    # ------------------------------------------------------------------------------------

    def _pack(self, samples: list[Sample]) -> Any:
        """The backend's form of one micro-batch (kept on :attr:`MicroBatch.packed`); None by default."""
        return None

    def _forward_log_probs(self, model: torch.nn.Module, batches: list[MicroBatch], *,
                           replay_routes: bool = False) -> list[Tensor] | None:
        """No-grad log-probs of ``model`` (the policy or the reference) at ``logits / temperature``; with
        ``replay_routes`` its MoE layers replay the samples' routed experts (checked already).

        Returns:
            One float32 ``[R_s]`` CPU tensor per sample of ``batches``, in order; None on a rank that computes
            no loss (a pipeline stage before the last).
        """
        raise NotImplementedError

    def _forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Forward and backward of one optimizer step's micro-batches with the shared GRPO loss
        (:func:`slime.grpo.loss.grpo_micro_batch_loss` with ``global_normalizer=normalizer``), leaving
        on the parameters the gradient of the step's global mean loss (data-parallel averaging undone).

        Returns:
            Per micro-batch its 0-d tensors ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``entropy``
            (and ``kl_loss``): its share of the step's values; ``[]`` on a rank that computes no loss.
        """
        raise NotImplementedError

    def _grad_norm(self) -> float:
        """The global L2 norm of the step's gradient over every rank's shards (each parameter once). Collective."""
        raise NotImplementedError

    def _apply_update(self, lr: float, grad_scale: float) -> None:
        """Multiply every gradient by ``grad_scale`` (<= 1, :func:`clip_coefficient`), take one AdamW step at
        ``lr`` and leave no gradient behind for the next step."""
        raise NotImplementedError

    def _input_embedding(self) -> torch.nn.Module | None:
        """The policy's token-embedding module on this rank (None where it holds none)."""
        raise NotImplementedError

    def _route_shape(self) -> RouteShape:
        """The policy's routed experts per position; NotImplementedError (saying why) where it cannot replay them."""
        raise NotImplementedError(f"{type(self).__name__} cannot replay routed experts")

    def _placeholder_ids(self) -> set[int]:
        """The model's image / video placeholder ids (the log-prob gap leaves out what follows a generated one)."""
        return set()

    def _dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group for CPU tensors (normalisers, micro-batch counts); None: the whole world."""
        return None

    def _metric_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Per-rank metric sums -> sums over micro-batches and data-parallel ranks (collective)."""
        return all_reduce_sums(values)

    def _step_metrics(self, batches: list[MicroBatch]) -> dict[str, float]:
        """The backend's own metrics of one step (averaged over steps like the others); none by default."""
        return {}

    # ------------------------------------------------------------------------------------
    # weights out, checkpoints
    # ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's share of the full weights, by Hugging Face checkpoint name, for the weight sync.

        The contract every backend keeps (:mod:`slime.weight_sync.base`):

        - a rank yields only the tensors it is the **source** of, whole (unsharded) and under their Hugging
          Face checkpoint names; the union over all ranks is the whole model, each name exactly once;
        - collective and in lockstep: every rank must exhaust the iterator, and every rank yields the same
          number of buckets, bucket ``k`` of each rank being its share of round ``k`` (``[]`` on a rank that
          is not a source in that round), so a transport may run its own collectives between buckets;
        - a bucket holds whole layers, about ``bucket_bytes`` bytes (:mod:`slime.weight_sync.buckets`).

        Args:
            bucket_bytes: target bucket size, bytes (``--update-weight-buffer-size``), > 0.
            device: where the yielded tensors live: ``"cpu"`` (the object store), or ``None`` for this
                rank's device (IPC / NCCL transports).  Dtype: the backend's compute dtype.

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

        The default suits pure data parallelism (FSDP): every rank is its own data-parallel rank.
        Backends with tensor/pipeline/context parallelism override it so that peers of one model replica
        receive the same samples.
        """
        return dist.get_rank(), dist.get_world_size()

    def _require_init(self) -> None:
        """Raises ``RuntimeError`` before :meth:`init` built the model."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.init() must run before train / compute_log_probs / save / "
                               "weight sync")

    # ------------------------------------------------------------------------------------
    # colocated memory (--colocate on GPU): the hand-over logic, once for every backend
    # ------------------------------------------------------------------------------------

    device: torch.device = torch.device("cpu")
    """This rank's device; the backend sets it in :meth:`init`.  Only a CUDA device moves memory."""
    model: torch.nn.Module | None = None
    """The policy module (None before :meth:`init`): nothing moves before the model exists."""
    ref_model: torch.nn.Module | None = None
    """The frozen reference model, built by :meth:`init` only when a KL term needs it."""
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

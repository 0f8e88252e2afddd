"""The training-backend interface, and the training step written once.

One :class:`TrainerBackend` per trainer rank, each in a Ray actor of :class:`slime.ray.trainer_group.TrainerGroup`;
``--train-backend`` picks ``fsdp`` (the Hugging Face model under FSDP2) or ``megatron`` (the native Megatron-core
model).  :meth:`TrainerBackend.train` is every backend's training step, and a backend supplies its hooks (the private
methods from :meth:`~TrainerBackend._pack` on; why: ``docs/design/training_step.md``).  Weights leave by Hugging
Face name; a backend's flags, checks and checkpoint layout are its :class:`slime.backends.config.BackendConfig`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.freeze import freeze, gather_names, select_frozen
from slime.backends.lr_schedule import LRSchedule
from slime.backends.rounding import rounding_step_noise
from slime.backends.steps import (
    check_train_samples, loss_normalizer, plan_micro_batches, split_into_steps,
)
from slime.backends.train_metrics import (
    EXTREMA,
    all_reduce_extrema,
    all_reduce_sums,
    check_gap_threshold,
    extrema_over_steps,
    fold_extremum,
    logprob_gap_metrics,
    neutral_extremum,
    logprob_gap_sums,
    route_agreement_sums,
)
from slime.data.routes import RouteError, RouteShape, check_routes
from slime.data.sample import Sample
from slime.grpo.token_advantages import Whitening, token_advantages, whitening_of, whitening_sums
from slime.utils.timer import PhaseClock

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""Colocated memory: the policy's parameters, what :meth:`TrainerBackend.onload` with ``weights_only`` brings back
(the weight sync and :meth:`TrainerBackend.compute_log_probs` read them)."""
TRAINING_STATE = "training_state"
"""Colocated memory: what only the optimizer step needs: optimizer state (fp32 main weights, Adam moments),
gradient buffers, the reference model."""


TRAINER_TOTAL_KEY = "perf/train_in_trainer_s"
"""Seconds :meth:`TrainerBackend.train` took on the trainer rank, its sub-phases and what lies between them; the driver
counts the rest of its call as ``perf/train_transfer_s`` (:mod:`slime.utils.step_times`)."""


class NonFiniteGradNorm(FloatingPointError):
    """The global gradient norm is NaN or infinite; no update was applied."""


@dataclasses.dataclass
class RankInfo:
    """Where this rank sits in the trainer world: ``rank`` in ``0 .. world_size - 1``, the rendezvous ``master_addr`` /
    ``master_port`` of rank 0, and ``device``, ``"cuda"`` (NCCL process group) or ``"cpu"`` (gloo)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as the skeleton hands it to the hooks: the ``indices`` of its ``samples`` in the list given to
    :meth:`TrainerBackend.train` (or ``compute_log_probs``), ``packed`` (what :meth:`~TrainerBackend._pack` made of
    them), and per sample the float32 ``[R_s]`` CPU ``old_log_probs``, ``ref_log_probs`` and ``rollout_log_probs``,
    set before the first update (None before, without a KL term, without ``--use-tis`` / ``--use-opsm``, and on
    ranks that compute no loss)."""

    indices: list[int]
    samples: list[Sample]
    packed: Any = None
    old_log_probs: list[Tensor] | None = None
    ref_log_probs: list[Tensor] | None = None
    rollout_log_probs: list[Tensor] | None = None
    routes: list[np.ndarray] | None = None
    """Per sample the uint8 ``[P + R - 1, layers, top_k]`` experts a forward with ``replay_routes`` (and every
    training forward, when set) takes: the engine's (R3) or the old-log-prob pass's (R2); None: the router's own."""
    trainer_routes: list[np.ndarray] | None = None
    """Per sample the experts the policy's routers chose in a ``capture_routes`` pass, same layout."""
    advantage_whitening: Whitening | None = None
    """With ``--normalize-advantages``: the rollout step's statistics over every rank (:meth:`TrainerBackend.train`)."""


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor ``--clip-grad`` scales every gradient by: ``min(1, max_norm / (grad_norm + 1e-6))``, in
    float32 as ``torch.nn.utils.clip_grad_norm_`` computes it; 1.0 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return float(torch.clamp(max_norm / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6), max=1.0))


class TrainerBackend(abc.ABC):
    """One rank of a training backend; every public method is collective (the group calls it on all ranks).

    Args:
        rank_info: this rank's place in the trainer world.
        train, optimizer, grpo, checkpoint: BACKEND_ARGS, OPTIMIZER_ARGS, the GRPO flags, CKPT_ARGS.
        rollout_temperature: ``--rollout-temperature`` (> 0); log-probs are of ``softmax(logits / temperature)``.
        num_rollout: rollout steps of the run, or None (a decaying LR schedule then needs ``--lr-decay-iters``).
        num_steps_per_rollout: optimizer steps per rollout.  seed: rank ``r`` seeds torch with ``seed + r``.

    Raises:
        ValueError: ``num_steps_per_rollout < 1``.
        ConfigError: an inconsistent LR schedule (:class:`LRSchedule`).
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
        """Build the model, optimizer and (with a KL term) the reference model from the weights
        :func:`slime.backends.weight_sources.resolve_weights` names; returns the next rollout id (0 for a fresh run,
        ``k + 1`` after loading the checkpoint of rollout ``k``)."""

    # ------------------------------------------------------------------------------------
    # the training step
    # ------------------------------------------------------------------------------------

    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """Run ``num_steps`` optimizer steps over this rank's samples (its share of every step, in order: ``num_steps``
        chunks of ``global_batch_size / dp_size``, with advantages and rollout log-probs).

        Returns:
            Metrics averaged over the steps, the same on every rank: ``train/{loss, pg_loss, pg_clipfrac, ppo_kl,
            entropy, kl_loss (with a KL loss), grad_norm (before clipping), lr}``, with ``--use-tis``
            ``train/tis_weight_{mean, min, max}`` (the ``_min`` / ``_max`` over all steps) and ``train/tis_clipfrac``,
            with ``--use-opsm`` ``train/opsm_masked_frac``, with ``--get-mismatch-metrics`` ``train/mis_*``, the
            backend's :meth:`_step_metrics`, the mismatch monitor (:mod:`slime.backends.train_metrics`; not with
            ``--use-rollout-logprobs``) and on a colocated GPU the free-memory figures of :meth:`memory_metrics`.
            Routing replay (R3 / R2) and the monitor's router agreement: ``docs/design/routing_replay.md``.

        Raises:
            SampleError: a malformed sample on any rank, no ``rollout_log_probs`` with ``--use-rollout-logprobs``,
                ``--use-tis`` or ``--use-opsm``, or with ``--use-rollout-routing-replay`` routes missing or malformed
                (before any forward).
            LogprobGapError: the gap passes ``--ci-train-rollout-logprob-abs-diff-threshold`` (no update applied).
            ValueError: ``len(samples)`` is not a positive multiple of ``num_steps``.
            NonFiniteGradNorm: the gradient norm is not finite (no update applied).
            RuntimeError: before :meth:`init`, or the optimizer state is offloaded (no :meth:`onload`).
        """
        self._require_init()
        self._require_on_device("train()", training=True)
        started = time.perf_counter()
        clock = PhaseClock("train", self.device)
        r3, r2 = self.train_cfg.use_rollout_routing_replay, self.train_cfg.use_routing_replay
        with clock("checks"):
            shape = self._route_shape() if r2 else self._monitored_route_shape()
            check_train_samples(samples, need_rollout_log_probs=self._rollout_log_prob_flags(),
                                routes=shape if r3 else None)
        with clock("pack"):
            steps = [self._micro_batches(samples, indices, self._dp_group())
                     for indices in split_into_steps(range(len(samples)), num_steps)]
            everything = [batch for batches in steps for batch in batches]
            for batch in everything if r3 else ():
                batch.routes = [s.rollout_routed_experts for s in batch.samples]
        gap: dict[str, float] = {}
        with clock("old_log_probs"):
            if self.train_cfg.use_rollout_logprobs:
                old = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
            else:
                # R2's record; the monitor's router agreement where engine routes exist (with R3: the experts taken)
                capture = shape is not None and (r2 or any(s.rollout_routed_experts is not None for s in samples))
                old = self._log_probs_by_sample(self.model, everything, len(samples), replay_routes=r3,
                                                capture_routes=capture)
                found = [] if old is None else samples  # ranks that compute no loss add zeros
                sums = logprob_gap_sums(found, old or [], self._placeholder_ids())
                if shape is not None:
                    sums.update(self._agreement_sums(everything if capture else [], shape))
                gap = logprob_gap_metrics(self._metric_sum(sums))
                check_gap_threshold(gap, self.train_cfg.ci_train_rollout_logprob_abs_diff_threshold, rollout_id)
        for batch in everything if r2 and not r3 else ():
            batch.routes = batch.trainer_routes  # R2: the old-log-prob pass's routes, in every optimizer step
        ref = None
        if self.ref_model is not None:
            with clock("ref_log_probs"):
                ref = self._log_probs_by_sample(self.ref_model, everything, len(samples), replay_routes=r3)
        with clock("pack"):
            whitening = self._advantage_whitening(samples, old, ref) if self.grpo.normalize_advantages else None
            for batch in everything:
                batch.old_log_probs = None if old is None else [old[i] for i in batch.indices]
                batch.ref_log_probs = None if ref is None else [ref[i] for i in batch.indices]
                batch.advantage_whitening = whitening
                if self.grpo.needs_rollout_log_probs and old is not None:
                    batch.rollout_log_probs = [torch.tensor(s.rollout_log_probs, dtype=torch.float32)
                                               for s in batch.samples]

        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        extremes: dict[str, list[float]] = defaultdict(list)
        for batches in steps:
            for name, value in self._optimizer_step(rollout_id, batches, clock).items():
                if name.endswith(EXTREMA):
                    extremes[name].append(value)
                else:
                    totals[name] += value
        with clock("metrics"):
            metrics = {name: value / num_steps for name, value in totals.items()}
            metrics.update(extrema_over_steps(extremes))
            metrics.update(gap)
            metrics.update(self.memory_metrics())
        metrics.update(clock.metrics())
        metrics[TRAINER_TOTAL_KEY] = time.perf_counter() - started
        return metrics

    def _advantage_whitening(self, samples: list[Sample], old: list[Tensor] | None,
                             ref: list[Tensor] | None) -> Whitening:
        """``--normalize-advantages``: the mean and spread of every loss-masked token's advantage (after
        :func:`~slime.grpo.token_advantages.token_advantages`) over this rollout's samples on all data-parallel ranks,
        once per rollout (upstream whitens once per rollout too).  Collective; ranks that compute no loss add zeros."""
        sums = {"adv/sum": 0.0, "adv/sum_sq": 0.0, "adv/tokens": 0.0}
        for i, sample in enumerate(samples if old is not None else ()):
            mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
            token_adv = token_advantages(torch.tensor([sample.advantage], dtype=torch.float32), mask, self.grpo,
                                         old_log_probs=old[i], ref_log_probs=None if ref is None else ref[i])
            for name, value in whitening_sums(token_adv, mask).items():
                sums[name] += value
        return whitening_of(self._metric_sum(sums))

    def _optimizer_step(self, rollout_id: int, batches: list[MicroBatch], clock: PhaseClock) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of it; returns its metrics, reduced over ranks.  Its time
        goes to ``clock``'s ``forward_backward``, ``optimizer`` and ``metrics`` sub-phases."""
        terms = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", *self.grpo.correction_metrics()[0]]
        if self.grpo.use_kl_loss and self.ref_model is not None:
            terms.append("kl_loss")
        with clock("forward_backward"):
            step_samples = [sample for batch in batches for sample in batch.samples]
            normalizer = loss_normalizer(step_samples, self.grpo.calculate_per_token_loss, group=self._dp_group())
            values = self._forward_backward(batches, normalizer)
        with clock("optimizer"):
            lr = self.lr_schedule(self.optimizer_steps)
            grad_norm = self._grad_norm()
            if not math.isfinite(grad_norm):
                raise NonFiniteGradNorm(
                    f"rollout {rollout_id}, optimizer step {self.optimizer_steps}: gradient norm is {grad_norm}; "
                    "lower --lr, check the rewards/advantages for NaN, or train in float32 (no --bf16)"
                )
            self._apply_update(lr, clip_coefficient(grad_norm, self.optim_cfg.clip_grad))
            self.optimizer_steps += 1
        with clock("metrics"):
            sums = {f"train/{name}": 0.0 for name in terms}
            extremes = {f"train/{name}": neutral_extremum(name) for name in self.grpo.correction_metrics()[1]}
            if values:  # one device-to-host copy per step, not one per term and micro-batch
                table = _to_host_table([[v[name] for name in terms] for v in values])
                for j, name in enumerate(terms):
                    sums[f"train/{name}"] = float(table[:, j].sum())
            for v in values:
                for name in extremes:
                    extremes[name] = fold_extremum(name, extremes[name], float(v[name.removeprefix("train/")]))
            return {**self._metric_sum(sums), **all_reduce_extrema(extremes), "train/grad_norm": grad_norm,
                    "train/lr": lr, **self._step_metrics(batches)}

    def _monitored_route_shape(self) -> RouteShape | None:
        """The policy's route shape where the monitor can measure router agreement (an MoE policy in a layout that
        replays routes), else None."""
        try:
            return self._route_shape()
        except NotImplementedError:
            return None

    def _agreement_sums(self, batches: list[MicroBatch], shape: RouteShape) -> dict[str, float]:
        """:func:`route_agreement_sums` of the captured routes against the engine's, for the samples that carry
        well-formed engine routes (the others are counted in ``routes/skipped`` and logged)."""
        pairs, skipped = [], []
        for batch in batches:
            for sample, mine in zip(batch.samples, batch.trainer_routes or [], strict=False):
                if sample.rollout_routed_experts is None:
                    continue
                try:
                    check_routes(sample.rollout_routed_experts, len(sample.prompt_token_ids), sample.response_length,
                                 shape, f"sample {sample.index}")
                except RouteError as e:
                    skipped.append(str(e))
                    continue
                pairs.append((sample, mine))
        if skipped:
            logger.warning("%d sample(s) with malformed engine routes are left out of train/router_agreement "
                           "(first: %s)", len(skipped), skipped[0])
        return {**route_agreement_sums(pairs), "routes/skipped": float(len(skipped))}

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]] | None:
        """Per-token log-probs (nats) of each sample's response under the current policy at ``logits / temperature``, no
        grad, for the engine parity check (every rank passes the same samples); ``rounding_noise``: with
        :func:`slime.backends.rounding.rounding_step_noise`; ``replay_routes``: every MoE layer takes each sample's
        ``rollout_routed_experts`` at positions ``0 .. P + R - 2`` (:func:`slime.models.routes.forced_gate_weights`).

        Returns:
            One list of R floats per sample; None on a rank that computes no loss (unless the backend shares the lists).

        Raises:
            SampleError: a malformed sample; with ``replay_routes``, routes missing or of another shape (naming the
                sample).
            NotImplementedError: ``replay_routes`` where the model or layout cannot replay them (:meth:`_route_shape`).
        """
        self._require_init()
        self._require_on_device("compute_log_probs()", training=False)
        check_train_samples(samples, routes=self._route_shape() if replay_routes else None)
        batches = self._micro_batches(samples, range(len(samples)), None)
        for batch in batches if replay_routes else ():
            batch.routes = [s.rollout_routed_experts for s in batch.samples]
        with rounding_step_noise(self._input_embedding() if rounding_noise else None):
            log_probs = self._log_probs_by_sample(self.model, batches, len(samples), replay_routes=replay_routes)
        return None if log_probs is None else [lp.tolist() for lp in log_probs]

    def _rollout_log_prob_flags(self) -> str:
        """The flags that need every sample's ``rollout_log_probs`` (for :func:`check_train_samples`; "" if none)."""
        flags = [name for name, on in (("--use-rollout-logprobs", self.train_cfg.use_rollout_logprobs),
                                       ("--use-tis", self.grpo.use_tis), ("--use-opsm", self.grpo.use_opsm),
                                       ("--get-mismatch-metrics", self.grpo.get_mismatch_metrics)) if on]
        return " / ".join(flags)

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

    def _log_probs_by_sample(self, model, batches: list[MicroBatch], count: int, *, replay_routes: bool = False,
                             capture_routes: bool = False) -> list[Tensor] | None:
        """:meth:`_forward_log_probs` of ``batches``, as one tensor per sample position ``0 .. count - 1``."""
        found = self._forward_log_probs(model, batches, replay_routes=replay_routes, capture_routes=capture_routes)
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

    def _forward_log_probs(self, model: torch.nn.Module, batches: list[MicroBatch], *, replay_routes: bool = False,
                           capture_routes: bool = False) -> list[Tensor] | None:
        """No-grad log-probs of ``model`` (policy or reference): one float32 ``[R_s]`` CPU tensor per sample, in
        order; None on a rank that computes no loss.  ``replay_routes``: every MoE layer takes each batch's
        :attr:`MicroBatch.routes`; ``capture_routes``: the routers' own choices go to
        :attr:`MicroBatch.trainer_routes`."""
        raise NotImplementedError

    def _forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Forward and backward of one step's micro-batches with :func:`slime.grpo.loss.grpo_micro_batch_loss` at
        ``global_normalizer=normalizer``, leaving the gradient of the step's mean loss; per micro-batch its 0-d shares
        of the loss terms of :meth:`train` (``[]`` on a rank that computes no loss).  A batch whose
        :attr:`MicroBatch.routes` is set replays them (R2 / R3), backward included."""
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
        self, bucket_bytes: int, device: str | torch.device | None = None, skip_frozen: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's share of the full weights by Hugging Face checkpoint name for the weight sync: the tensors it is
        the source of, whole, each name once over all ranks, whole layers per bucket of about ``bucket_bytes`` (> 0), in
        the compute dtype on ``device`` (None: this rank's); ``skip_frozen``: without the :attr:`frozen` parameters.  Collective and in lockstep: every rank exhausts the
        iterator and yields the same number of buckets (``[]`` where it sources nothing).  ``ValueError`` when
        ``bucket_bytes <= 0``."""

    @abc.abstractmethod
    def save(self, rollout_id: int, path: Path) -> None:
        """Write this backend's checkpoint of ``rollout_id`` into the iteration folder ``path`` (its parts:
        :meth:`slime.backends.config.BackendConfig.checkpoint_parts`; the driver adds the rest). Collective."""

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """This rank's (data-parallel rank, size); default: every rank is its own (FSDP)."""
        return dist.get_rank(), dist.get_world_size()

    # ------------------------------------------------------------------------------------
    # freezing by name (--freeze-params-name-list / --only-train-params-name-list)
    # ------------------------------------------------------------------------------------

    frozen: frozenset[str] = frozenset()
    """This rank's frozen policy parameters, by the backend's own names (set by :meth:`_freeze_policy`)."""
    frozen_hf_names: frozenset[str] = frozenset()
    """The checkpoint names of every frozen tensor, over all ranks (what the weight sync sends once)."""

    def _freeze_policy(self) -> None:
        """Freeze the policy's parameters the flags name (:mod:`slime.backends.freeze`); the backend calls it in
        :meth:`init` after building the policy and before building the optimizer. Collective when a flag is given.

        Raises:
            ConfigError: a pattern matches nothing, matches part of a fused tensor, or freezes everything.
        """
        cfg = self.train_cfg
        if not (cfg.freeze_params_name_list or cfg.only_train_params_name_list):
            return
        names = self._hf_names_by_param()
        chosen = select_frozen(names, freeze=cfg.freeze_params_name_list,
                               only_train=cfg.only_train_params_name_list, device=self.device)
        count = freeze(self.model, chosen)
        self.frozen = frozenset(chosen)
        self.frozen_hf_names = frozenset(gather_names({hf for name in chosen for hf in names[name]}))
        logger.info("frozen: %d parameters on this rank (%d elements), %d checkpoint tensors in all",
                    len(chosen), count, len(self.frozen_hf_names))

    def _hf_names_by_param(self) -> dict[str, list[str]]:
        """This rank's policy parameters as ``{backend name: its Hugging Face checkpoint names}``."""
        raise NotImplementedError(f"{type(self).__name__} cannot freeze parameters by name")

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
        """Move this rank's training memory off the GPU for colocated engines: :data:`TRAINING_STATE`, then (unless
        ``keep_weights``) :data:`WEIGHTS`, each only if it is on the device; tracked but not moved on CPU. Collective.
        On CUDA records ``perf/<phase>_free_gib_{before,after}_offload[_keep_weights]`` (GiB; ``<phase>``: ``resync``
        after ``onload(weights_only=True)``, else ``train``).  The call order: ``docs/design/colocate.md``."""
        name = "offload_keep_weights" if keep_weights else "offload"
        self._hand_over([TRAINING_STATE] if keep_weights else [TRAINING_STATE, WEIGHTS], False,
                        f"{self._figure_phase}_free_gib", name)

    def onload(self, weights_only: bool = False) -> None:
        """Undo :meth:`offload`, weights first; ``weights_only``: :data:`WEIGHTS` alone, enough for the weight sync and
        :meth:`compute_log_probs`. Collective.  Records ``perf/train_free_gib_{before,after}_onload`` (or
        ``perf/resync_free_gib_{before,after}_onload_weights``)."""
        self._figure_phase = "resync" if weights_only else "train"
        self._hand_over([WEIGHTS] if weights_only else [WEIGHTS, TRAINING_STATE], True,
                        f"{self._figure_phase}_free_gib", "onload_weights" if weights_only else "onload")

    def memory_metrics(self) -> dict[str, float]:
        """The free-memory figures (GiB) recorded by :meth:`offload` / :meth:`onload` since the last call, then
        forgotten, so that each move is in one step's metrics; ``{}`` on CPU."""
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
        """Move one part (:data:`WEIGHTS`, :data:`TRAINING_STATE`) onto or off this rank's CUDA device; called only on
        CUDA after :meth:`init`, once per part and direction.  Default: nothing moves."""

    def _require_on_device(self, what: str, *, training: bool) -> None:
        """Raise ``RuntimeError`` (naming ``what`` and the missing :meth:`onload`) unless the weights, and with
        ``training`` the optimizer state too, are on the device."""
        missing = self._offloaded if training else self._offloaded & {WEIGHTS}
        if missing:
            call = "onload()" if training else "onload() or onload(weights_only=True)"
            raise RuntimeError(f"{what} needs this rank's {' and '.join(sorted(missing))} on the device, but "
                               f"offload() moved them off: call {call} first")


def _to_host_table(rows: list[list[Tensor | float]]) -> Tensor:
    """Scalars (0-d tensors on one device, or numbers) as one float64 ``[len(rows), len(rows[0])]`` CPU tensor, copied
    to the host at once."""
    flat = [torch.as_tensor(x).detach() for row in rows for x in row]
    device = next((x.device for x in flat if x.device.type != "cpu"), torch.device("cpu"))
    table = torch.stack([x.to(device=device, dtype=torch.float64).reshape(()) for x in flat])
    return table.cpu().view(len(rows), -1)


def _free_gib(device: torch.device) -> float:
    """Free memory of ``device`` as the driver reports it (``cudaMemGetInfo``), GiB."""
    free, _ = torch.cuda.mem_get_info(device)
    return free / float(1 << 30)

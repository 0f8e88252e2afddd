"""The training step of every backend: :func:`train_step`, one function read top to bottom, over a small protocol.

A backend (``--train-backend``) implements :class:`StepBackend` (``pack``, ``log_probs``, ``forward_backward``,
``grad_norm``, ``apply_update``, its reductions as one :class:`~slime.backends.train_metrics.DataParallel` value) by
being such an object, not by subclassing; the step owns every decision (micro-batches, old and reference log-probs,
the loss normaliser, the learning rate, the finite-norm check, clipping, metrics).  Routing replay is one pass
around the old-log-prob pass (:class:`slime.routing_replay.StepRoutes`); the colocated memory hand-over is the
backend's :class:`slime.backends.handover.HandOver`.  Why the cut is here: ``docs/design/training_step.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Protocol, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.config import TrainerSpec
from slime.backends.handover import HandOver
from slime.backends.rounding import rounding_step_noise
from slime.backends.samples import check_train_samples
from slime.backends.train_metrics import DataParallel, metrics_over_steps, mismatch_monitor
from slime.data.sample import Sample
from slime.grpo.loss import loss_metric_names
from slime.grpo.token_advantages import Whitening, rollout_whitening
from slime.routing_replay import RouteShape, StepRoutes, route_problem
from slime.utils.timer import PhaseClock

logger = logging.getLogger(__name__)

T = TypeVar("T")

PEAK_MEMORY_KEY = "perf/train_peak_gib"
"""GiB a CUDA rank held at most during :func:`train_step` (``torch.cuda.max_memory_allocated``, reset as the step
starts: weights, gradients, optimizer state and the largest micro-batch's activations); the trainer group reports the
largest over ranks.  Absent on CPU."""

RESERVED_PEAK_KEY = "perf/train_reserved_peak_gib"
"""GiB the CUDA caching allocator held from the device at most during the step (``torch.cuda.max_memory_reserved``,
reset as the step starts): at least :data:`PEAK_MEMORY_KEY` (allocated blocks and cached free ones); near the memory
the engines left free, the allocator retries (:data:`ALLOC_RETRIES_KEY`).  Absent on CPU."""

ALLOC_RETRIES_KEY = "perf/train_alloc_retries"
"""How often during the step the CUDA caching allocator found no free block, returned all its cached blocks to the
device and asked again (the increase of ``torch.cuda.memory_stats()["num_alloc_retries"]``; each such retry
synchronises the device).  Nonzero: the step ran at the card's memory limit and paid for it in time (lower
``--max-tokens-per-gpu``).  Absent on CPU."""

DEVICE_ALLOCS_KEY = "perf/train_device_allocs"
"""How many times the CUDA caching allocator took memory from the device during the step (the increase of
``torch.cuda.memory_stats()["num_device_alloc"]``: ``cudaMalloc`` calls, or with ``expandable_segments`` the
``cuMemMap`` calls that grow a segment).  After the colocated offload's ``empty_cache`` the
step's first activations come from fresh segments; where the old-log-prob pass is skipped, those calls land in the
forward.  Absent on CPU."""

LARGEST_OVER_RANKS = (PEAK_MEMORY_KEY, RESERVED_PEAK_KEY, ALLOC_RETRIES_KEY, DEVICE_ALLOCS_KEY)
"""The step's memory figures the trainer group reports as the largest over its ranks (the rest: rank 0's)."""

FORWARD_LOG_PROBS = "forward_log_probs"
"""The key under which :meth:`StepBackend.forward_backward` returns, for a micro-batch whose ``old_log_probs`` is
None (``--skip-actor-forward-only``), its forward's detached log-probs: float32 ``[R_s]`` CPU tensors, one per
sample in the micro-batch's order."""

TRAINER_TOTAL_KEY = "perf/train_in_trainer_s"
"""Seconds :func:`train_step` took on the trainer rank, its sub-phases and what lies between them; the driver counts
the rest of its call as ``perf/train_transfer_s`` (:meth:`slime.ray.trainer_group.TrainerGroup.train`)."""


class NonFiniteGradNorm(FloatingPointError):
    """The global gradient norm is NaN or infinite; no update was applied."""


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as the step hands it to the backend: the ``indices`` of its ``samples`` in the step's list,
    ``packed`` (what :meth:`StepBackend.pack` made of them), and per sample the float32 ``[R_s]`` CPU
    ``old_log_probs``, ``ref_log_probs`` and ``rollout_log_probs``, set before the first update (None before, without
    a KL term, without ``--use-tis`` / ``--use-opsm``, and on ranks that compute no loss)."""

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
    """With ``--normalize-advantages``: the rollout step's statistics over every rank
    (:func:`slime.grpo.token_advantages.rollout_whitening`)."""


class StepBackend(Protocol):
    """What :func:`train_step` needs of a backend rank (FSDP: :class:`slime.backends.fsdp.backend.FSDPBackend`,
    Megatron: :class:`slime.backends.megatron.backend.MegatronBackend`).  Its attributes are set by its ``init``:
    ``spec`` (the rank's flag groups and LR schedule), ``device``, ``model`` / ``ref_model`` (the reference None
    without a KL term), ``optimizer_steps`` (taken so far, restored on resume), ``dp``, ``placeholder_ids`` (the
    image / video ids the gap leaves out after) and ``memory``."""

    spec: TrainerSpec
    device: torch.device
    model: torch.nn.Module | None
    ref_model: torch.nn.Module | None
    optimizer_steps: int
    dp: DataParallel
    placeholder_ids: set[int]
    memory: HandOver

    def pack(self, samples: list[Sample]) -> Any:
        """The backend's form of one micro-batch (kept on :attr:`MicroBatch.packed`; FSDP: None)."""

    def log_probs(self, model: torch.nn.Module, batches: list[MicroBatch], *, replay_routes: bool = False,
                  capture_routes: bool = False) -> list[Tensor] | None:
        """No-grad log-probs of ``model`` (policy or reference): one float32 ``[R_s]`` CPU tensor per sample, in
        order; None on a rank that computes no loss.  ``replay_routes``: every MoE layer takes each batch's
        :attr:`MicroBatch.routes`; ``capture_routes``: the routers' own choices go to
        :attr:`MicroBatch.trainer_routes`."""

    def forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Forward and backward of one step's micro-batches with :func:`slime.grpo.loss.grpo_micro_batch_loss` at
        ``global_normalizer=normalizer`` and each batch's :attr:`MicroBatch.advantage_whitening`, leaving the gradient
        of the step's mean loss; per micro-batch its 0-d shares of the loss terms (``[]`` on a rank that computes no
        loss), and where the batch's ``old_log_probs`` is None (the loss then takes the forward's own, detached) its
        log-probs under :data:`FORWARD_LOG_PROBS`.  Batches whose :attr:`MicroBatch.routes` is set replay them
        (R2 / R3), backward included."""

    def grad_norm(self) -> float:
        """The global L2 norm of the step's gradient over every rank's shards (each parameter once). Collective."""

    def apply_update(self, lr: float, grad_scale: float) -> dict[str, float]:
        """Multiply every gradient by ``grad_scale`` (<= 1, :func:`clip_coefficient`), take one AdamW step at ``lr``
        and leave no gradient behind for the next step; returns the backend's own metrics of the step (averaged over
        steps like the others; often none)."""

    def route_shape(self) -> RouteShape:
        """The policy's routed experts per position; NotImplementedError (saying why) where it cannot replay them."""

    def input_embedding(self) -> torch.nn.Module | None:
        """The policy's token-embedding module on this rank (None where it holds none)."""


def train_step(backend: StepBackend, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
    """``num_steps`` optimizer steps over this rank's samples (its share of every step, in order: ``num_steps`` equal
    chunks, with advantages and rollout log-probs).  The old log-probs come from a pass before the first update, the
    rollout (``--use-rollout-logprobs``) or, with ``--skip-actor-forward-only`` (one step), the training forward.

    Returns:
        Metrics averaged over the steps, the same on every rank: ``train/{loss, pg_loss, pg_clipfrac, ppo_kl,
        entropy, kl_loss (with a KL loss), grad_norm (before clipping), lr}``, the IS / OPSM metrics of ``--use-tis`` /
        ``--use-opsm`` (``_min`` / ``_max`` over all steps), ``train/mis_*`` of ``--get-mismatch-metrics``, the
        backend's own (``apply_update``'s), the mismatch monitor (not with ``--use-rollout-logprobs``), the colocated
        free-memory figures (GiB), ``perf/train_<sub>_s`` and on CUDA :data:`PEAK_MEMORY_KEY`,
        :data:`RESERVED_PEAK_KEY`, :data:`ALLOC_RETRIES_KEY` and :data:`DEVICE_ALLOCS_KEY`.

    Raises:
        SampleError: a malformed sample on any rank, or (R3) missing or malformed routes, before any forward.
        LogprobGapError: the gap passes ``--ci-train-rollout-logprob-abs-diff-threshold`` (no update applied).
        ValueError: ``len(samples)`` is not a positive multiple of ``num_steps``; ``--skip-actor-forward-only`` with
            more than one step, or with ``--kl-coef`` and ``--normalize-advantages``.
        NonFiniteGradNorm: the gradient norm is not finite (no update applied).
        RuntimeError: before ``init``, or the optimizer state is offloaded (no ``onload``).
    """
    memory_figures = backend.memory.begin_step()  # the colocated moves since the last step
    started, clock = time.perf_counter(), PhaseClock("train", backend.device)
    spec, dp, grpo = backend.spec, backend.dp, backend.spec.grpo
    allocator_counts = _start_cuda_memory_figures(backend.device)
    with clock("checks"):
        routes = StepRoutes.for_step(spec.train, backend.route_shape, samples)  # R3 / R2 / the monitor's routes
        check_train_samples(samples, need_rollout_log_probs=_rollout_log_prob_flags(spec),
                            routes_problem=routes.problem)
    with clock("pack"):
        steps = [micro_batches(backend, samples, indices, engine_routes=routes.engine, dp_group=dp.group)
                 for indices in split_into_steps(range(len(samples)), num_steps)]
        batches = [batch for step in steps for batch in step]
    monitor: dict[str, float] = {}  # the engine/trainer gap (and router agreement) of the old log-probs
    old, from_forward = None, _old_from_forward(spec, num_steps)
    with clock("old_log_probs"):
        if spec.train.use_rollout_logprobs:
            old = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
        elif not from_forward:
            old = log_probs_by_sample(backend, backend.model, batches, len(samples), replay_routes=routes.engine,
                                      capture_routes=routes.capture)
            monitor = _monitor(backend, samples, old, routes.after_old_pass(batches), rollout_id)
    ref = None
    if backend.ref_model is not None:
        with clock("ref_log_probs"):
            ref = log_probs_by_sample(backend, backend.ref_model, batches, len(samples), replay_routes=routes.engine)
    with clock("pack"):
        whitening = (rollout_whitening(samples if dp.computes_loss else [], old, ref, grpo, dp.sum)
                     if grpo.normalize_advantages else None)
        for batch in batches:
            batch.old_log_probs = None if old is None else [old[i] for i in batch.indices]
            batch.ref_log_probs = None if ref is None else [ref[i] for i in batch.indices]
            batch.advantage_whitening = whitening
            if grpo.needs_rollout_log_probs and dp.computes_loss:
                batch.rollout_log_probs = [torch.tensor(s.rollout_log_probs, dtype=torch.float32)
                                           for s in batch.samples]
    terms, extremes = loss_metric_names(grpo, with_kl_loss=backend.ref_model is not None)
    backend.model.train()
    values, scalars = [], []  # per optimizer step: its micro-batches' loss terms, its grad norm, lr and own metrics
    for step_batches in steps:
        with clock("forward_backward"):
            normalizer = loss_normalizer([s for batch in step_batches for s in batch.samples],
                                         grpo.calculate_per_token_loss, group=dp.group)
            values.append(backend.forward_backward(step_batches, normalizer))
        if from_forward:  # --skip-actor-forward-only: the monitor and its gate on the forward's, before the update
            monitor = _forward_monitor(backend, clock, samples, step_batches, values[-1], rollout_id)
        with clock("optimizer"):
            lr = spec.lr_schedule(backend.optimizer_steps)
            grad_norm = backend.grad_norm()
            if not math.isfinite(grad_norm):
                raise NonFiniteGradNorm(
                    f"rollout {rollout_id}, optimizer step {backend.optimizer_steps}: gradient norm is {grad_norm}; "
                    "lower --lr, check the rewards/advantages for NaN, or train in float32 (no --bf16)")
            own = backend.apply_update(lr, clip_coefficient(grad_norm, spec.optimizer.clip_grad))
            backend.optimizer_steps += 1
        scalars.append({"train/grad_norm": grad_norm, "train/lr": lr, **own})
    with clock("metrics"):
        metrics = {**metrics_over_steps(values, scalars, terms, extremes, dp), **monitor, **memory_figures}
    metrics.update(_cuda_memory_metrics(backend.device, allocator_counts))
    return {**metrics, **clock.metrics(), TRAINER_TOTAL_KEY: time.perf_counter() - started}


def _monitor(backend: StepBackend, samples: list[Sample], old: list[Tensor] | None, route_sums: dict[str, float],
             rollout_id: int) -> dict[str, float]:
    """:func:`mismatch_monitor` of the step's old log-probs ``old`` (None on a rank that computes no loss)."""
    return mismatch_monitor(samples, old, backend.placeholder_ids, route_sums, backend.dp,
                            backend.spec.train.ci_train_rollout_logprob_abs_diff_threshold, rollout_id)


def _forward_monitor(backend: StepBackend, clock: PhaseClock, samples: list[Sample], batches: list[MicroBatch],
                     values: list[dict[str, Any]], rollout_id: int) -> dict[str, float]:
    """:func:`_monitor` of the training forward's log-probs (``--skip-actor-forward-only``), timed as the step's
    ``old_log_probs`` sub-phase."""
    with clock("old_log_probs"):
        return _monitor(backend, samples, _by_sample(batches, values, len(samples)), {}, rollout_id)


def _by_sample(batches: list[MicroBatch], values: list[dict[str, Any]], count: int) -> list[Tensor] | None:
    """The :data:`FORWARD_LOG_PROBS` of a step's micro-batches as one tensor per sample position ``0 .. count - 1``;
    None where the backend returned none (a rank that computes no loss)."""
    if not values:
        return None
    return _by_position(batches, [lp for found in values for lp in found[FORWARD_LOG_PROBS]], count)


def _old_from_forward(spec: TrainerSpec, num_steps: int) -> bool:
    """Whether the step takes its old log-probs from the training forward (``--skip-actor-forward-only``).

    Raises:
        ValueError: the flag with ``num_steps`` > 1 (the later steps' old policy is the one before the first update),
            or with ``--kl-coef`` and ``--normalize-advantages`` (the whitening needs the old log-probs before the
            forward); :func:`slime.arguments.validate` refuses both before a run starts.
    """
    if spec.train.skip_actor_forward_only and num_steps != 1:
        raise ValueError(f"--skip-actor-forward-only needs one optimizer step per rollout step, got {num_steps}")
    if spec.train.skip_actor_forward_only and spec.grpo.kl_coef > 0 and spec.grpo.normalize_advantages:
        raise ValueError("--skip-actor-forward-only with --kl-coef and --normalize-advantages: the whitening needs the "
                         "old log-probs before the training forward")
    return spec.train.skip_actor_forward_only


def _start_cuda_memory_figures(device: torch.device) -> dict[str, int]:
    """On CUDA reset the peak memory figures and return the allocator's running counts (``num_alloc_retries``,
    ``num_device_alloc``); ``{}`` elsewhere."""
    if device.type != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats(device)  # the counts are running counts, not reset
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc")}


def _cuda_memory_metrics(device: torch.device, counts_before: dict[str, int]) -> dict[str, float]:
    """The step's peaks (GiB, since ``reset_peak_memory_stats``) and the increase of the allocator's running counts
    since ``counts_before`` (retries, device allocations); ``{}`` off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    grown = {k: float(stats.get(k, 0) - before) for k, before in counts_before.items()}
    return {PEAK_MEMORY_KEY: torch.cuda.max_memory_allocated(device) / 2**30,
            RESERVED_PEAK_KEY: torch.cuda.max_memory_reserved(device) / 2**30,
            ALLOC_RETRIES_KEY: grown["num_alloc_retries"], DEVICE_ALLOCS_KEY: grown["num_device_alloc"]}


def compute_log_probs(backend: StepBackend, samples: list[Sample], *, rounding_noise: bool = False,
                      replay_routes: bool = False) -> list[list[float]] | None:
    """Per-token log-probs (nats) of each sample's response under the current policy at ``logits / temperature``, no
    grad, for the engine parity check (every rank passes the same samples); ``rounding_noise``: with
    :func:`slime.backends.rounding.rounding_step_noise`; ``replay_routes``: every MoE layer takes each sample's
    ``rollout_routed_experts`` at positions ``0 .. P + R - 2`` (:func:`slime.routing_replay.forced_gate_weights`).

    Returns:
        One list of R floats per sample; None on a rank that computes no loss.

    Raises:
        SampleError: a malformed sample; with ``replay_routes``, routes missing or of another shape (naming it).
        NotImplementedError: ``replay_routes`` where the model or layout cannot replay them (``route_shape``).
        RuntimeError: before ``init``, or the weights are offloaded.
    """
    backend.memory.require("compute_log_probs()", training=False)
    shape = backend.route_shape() if replay_routes else None
    check_train_samples(samples, routes_problem=None if shape is None else route_problem(samples, shape))
    batches = micro_batches(backend, samples, range(len(samples)), engine_routes=replay_routes, dp_group=None)
    with rounding_step_noise(backend.input_embedding() if rounding_noise else None):
        log_probs = log_probs_by_sample(backend, backend.model, batches, len(samples), replay_routes=replay_routes)
    return None if log_probs is None else [lp.tolist() for lp in log_probs]


def _rollout_log_prob_flags(spec: TrainerSpec) -> str:
    """The flags that need every sample's ``rollout_log_probs`` (for :func:`check_train_samples`; "" if none)."""
    flags = [name for name, on in (("--use-rollout-logprobs", spec.train.use_rollout_logprobs),
                                   ("--use-tis", spec.grpo.use_tis), ("--use-opsm", spec.grpo.use_opsm),
                                   ("--get-mismatch-metrics", spec.grpo.get_mismatch_metrics)) if on]
    return " / ".join(flags)


def micro_batches(backend: StepBackend, samples: Sequence[Sample], indices: Sequence[int], *, engine_routes: bool,
                  dp_group: dist.ProcessGroup | None) -> list[MicroBatch]:
    """``samples[indices]`` planned into micro-batches (:func:`plan_micro_batches`: ``--micro-batch-size``, or
    ``--max-tokens-per-gpu`` bins agreed over ``dp_group``) and packed; ``engine_routes``: each batch's routes are
    its samples' ``rollout_routed_experts`` (R3)."""
    train = backend.spec.train
    chosen = [samples[i] for i in indices]
    max_tokens = train.max_tokens_per_gpu if train.use_dynamic_batch_size else None
    plan = plan_micro_batches(chosen, micro_batch_size=train.micro_batch_size, max_tokens=max_tokens,
                              dp_group=dp_group)
    batches = []
    for part in plan:
        members = [chosen[j] for j in part]
        routes = [s.rollout_routed_experts for s in members] if engine_routes else None
        batches.append(MicroBatch([indices[j] for j in part], members, backend.pack(members), routes=routes))
    return batches


def log_probs_by_sample(backend: StepBackend, model: torch.nn.Module, batches: list[MicroBatch], count: int, *,
                        replay_routes: bool = False, capture_routes: bool = False) -> list[Tensor] | None:
    """:meth:`StepBackend.log_probs` of ``batches``, as one tensor per sample position ``0 .. count - 1``."""
    found = backend.log_probs(model, batches, replay_routes=replay_routes, capture_routes=capture_routes)
    return None if found is None else _by_position(batches, found, count)


def _by_position(batches: list[MicroBatch], found: Sequence[Tensor], count: int) -> list[Tensor]:
    """``found``, one tensor per sample of ``batches`` in their order, as one per sample position ``0 .. count - 1``."""
    out: list[Tensor] = [None] * count  # type: ignore[list-item]
    for i, log_probs in zip((i for batch in batches for i in batch.indices), found, strict=True):
        out[i] = log_probs
    return out


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor ``--clip-grad`` scales every gradient by: ``min(1, max_norm / (grad_norm + 1e-6))``, in
    float32 as ``torch.nn.utils.clip_grad_norm_`` computes it; 1.0 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return float(torch.clamp(max_norm / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6), max=1.0))


# ------------------------------------------------------------------------------------ optimizer steps, micro-batches


def split_into_steps(samples: Sequence[T], num_steps: int) -> list[list[T]]:
    """Cut this rank's samples into ``num_steps`` consecutive equal chunks, one per optimizer step; ``ValueError``
    unless ``len(samples)`` is a positive multiple of ``num_steps >= 1``."""
    if num_steps < 1 or len(samples) == 0 or len(samples) % num_steps:
        raise ValueError(
            f"{len(samples)} samples cannot be cut into {num_steps} equal optimizer steps; the trainer group "
            "must send a positive multiple of num_steps samples to every rank (--global-batch-size / DP size each)"
        )
    size = len(samples) // num_steps
    return [list(samples[i * size : (i + 1) * size]) for i in range(num_steps)]


def split_into_micro_batches(samples: Sequence[T], micro_batch_size: int) -> list[list[T]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be smaller); ``ValueError`` below 1."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    return [list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]


def sample_tokens(sample: Sample) -> int:
    """Prompt + response tokens of one sample (its length in a packed micro-batch)."""
    return len(sample.prompt_token_ids) + sample.response_length


def balanced_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Item indices in ``num_bins`` (``1 .. len(lengths)``, else ``ValueError``) non-empty bins of nearly equal total
    length: longest-processing-time-first (Graham 1969), each item into the lightest bin; items in index order per bin.
    """
    if not 1 <= num_bins <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} samples into {num_bins} non-empty micro-batches")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def bins_for_budget(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest bins (at least the token total over the budget) in which :func:`balanced_bins` keeps
    every bin within ``max_tokens``, except a bin holding a single longer item."""
    n = len(lengths)
    k = max(1, min(n, -(-sum(lengths) // max_tokens)))
    while k < n and any(len(b) > 1 and sum(lengths[i] for i in b) > max_tokens for b in balanced_bins(lengths, k)):
        k += 1
    return k


def plan_micro_batches(
    samples: Sequence[Sample], *, micro_batch_size: int, max_tokens: int | None, dp_group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """One step's (or log-prob pass's) micro-batches, as lists of sample indices: runs of ``micro_batch_size``
    consecutive samples, or with ``max_tokens`` (``--max-tokens-per-gpu`` under ``--use-dynamic-batch-size``)
    :func:`balanced_bins` of at most that many tokens (a longer sample alone, logged), as many on every rank of
    ``dp_group`` (the most any rank needs: expert all-to-alls and megatron-core's schedule need one count; None: no
    agreement).

    Raises:
        ValueError: no samples, or ``micro_batch_size < 1``.
    """
    if not samples:
        raise ValueError("no samples to cut into micro-batches")
    if max_tokens is None:
        return split_into_micro_batches(list(range(len(samples))), micro_batch_size)
    lengths = [sample_tokens(s) for s in samples]
    long = [s.index for s, n in zip(samples, lengths) if n > max_tokens]
    if long:
        logger.warning("%d sample(s) exceed --max-tokens-per-gpu %d (first: sample %d, %d tokens); each gets a "
                       "micro-batch of its own", len(long), max_tokens, long[0], max(lengths))
    count = torch.tensor([bins_for_budget(lengths, max_tokens)])
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return balanced_bins(lengths, min(int(count), len(samples)))


def loss_normalizer(samples: Sequence[Sample], per_token: bool, group: dist.ProcessGroup | None = None) -> float:
    """``N`` of one optimizer step over the ranks of ``group``, for ``aggregate_loss(global_normalizer=N)``: the step's
    samples, or with ``per_token`` (``--calculate-per-token-loss``) its loss-masked response tokens.  Collective (an
    all-reduce over ``group``, which takes CPU tensors; None: the default group, no reduction without
    ``torch.distributed``).  A per-token step with every token masked gets ``N = 1`` (loss 0, no gradient), with a
    warning.

    Raises:
        ValueError: the step has no sample on any rank.
    """
    tokens = sum(int(sum(s.loss_mask)) for s in samples)
    counts = torch.tensor([len(samples), tokens], dtype=torch.float64)  # one all-reduce for both
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    num_samples, num_tokens = counts.tolist()
    if num_samples <= 0:
        raise ValueError("the optimizer step has no samples on any data-parallel rank; check the batch split")
    if not per_token:
        return num_samples
    if num_tokens <= 0:
        logger.warning(
            "every response token of this optimizer step is masked out of the loss (e.g. --overlong-filter with "
            "every sample truncated): the step's loss is 0 and gives no gradient"
        )
        return 1.0
    return num_tokens

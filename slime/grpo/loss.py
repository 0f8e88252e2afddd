"""The GRPO loss of one micro-batch: clipped policy loss, KL, entropy, aggregation.

Pure torch, no model, no ``torch.distributed``; float32 (float64 kept).  A backend calls
:func:`grpo_micro_batch_loss` once per micro-batch.  Sources and departures from upstream:
``docs/design/grpo.md``.

Token layouts: every per-token tensor of one call has one shape, padded ``[B, T]`` (row = sample,
``loss_mask`` 0 on padding) or packed ``[T]`` with ``cu_seqlens`` (int ``[S + 1]``, from 0,
non-decreasing; tokens after ``cu_seqlens[-1]`` must be masked; without it, one sample).  Masked
tokens never enter the arithmetic, so padding may hold garbage.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from slime.grpo.config import KL_TYPES, GRPOConfig
from slime.grpo.correction import gspo_log_ratio, importance_weights, masked_extrema, opsm_keep
from slime.grpo.layout import as_float as _float
from slime.grpo.layout import check_same_shape as _check_same_shape
from slime.grpo.layout import per_sample_sums, spread_per_sample

LOW_VAR_KL_BOUND = 10.0
"""``low_var_kl`` is k3 clamped to ``[-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND]`` (upstream slime / verl)."""


# --- KL reward shaping --------------------------------------------------------------


def apply_kl_penalty_to_advantages(
    advantages: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor, kl_coef: float, loss_mask: Tensor | None = None
) -> Tensor:
    """``A_t - kl_coef * (log pi_old(y_t) - log pi_ref(y_t))`` per token (``--kl-coef``; k1 of KL(pi_old || pi_ref)).

    Masked tokens keep their advantage; float32 (float64 kept), ``advantages``' shape.

    Raises:
        ValueError: ``kl_coef < 0`` or shapes differ.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef (--kl-coef) must be >= 0, got {kl_coef}")
    _check_same_shape(advantages=advantages, old_log_probs=old_log_probs)
    return _float(advantages) - kl_coef * compute_approx_kl(old_log_probs, ref_log_probs, "k1", loss_mask)


# --- per-token terms ----------------------------------------------------------------


class PolicyLossTerms(NamedTuple):
    """Per-token outputs of :func:`compute_policy_loss`, all 0 at masked-out tokens."""

    loss: Tensor
    """Clipped surrogate loss per token (to be minimised)."""
    clipped: Tensor
    """1.0 where the clipped branch is active (strictly larger), else 0.0."""
    log_ratio: Tensor
    """``log pi(y_t) - log pi_old(y_t)`` in nats; ``-log_ratio`` is the k1 estimate of KL(pi_old || pi)."""


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    *,
    sequence_level: bool = False,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate with clip-higher, per token (Schulman et al. 2017 eq. 7, negated; DAPO Sec. 3.1).

    ``loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_high))``, ``r_t = exp(log_probs -
    old_log_probs)``; with ``sequence_level`` (GSPO), ``r_t`` is its sample's geometric mean of the token ratios
    (:func:`slime.grpo.correction.gspo_log_ratio`, layout ``cu_seqlens``).  All inputs one shape (log-probs in
    nats); float32 (float64 kept) outputs.

    Raises:
        ValueError: shapes differ, or a malformed layout.
    """
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.bool()
    if sequence_level:
        log_ratio = gspo_log_ratio(log_probs, old_log_probs, mask, cu_seqlens)
    else:
        log_ratio = torch.where(mask, _float(log_probs) - _float(old_log_probs), 0.0)
    adv = torch.where(mask, _float(advantages), 0.0)
    ratio = log_ratio.exp()
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped_loss, clipped_loss),
        clipped=(clipped_loss > unclipped_loss).to(ratio.dtype),
        log_ratio=log_ratio,
    )


def compute_approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, kl_type: str, loss_mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate (nats) of ``KL(pi || pi_ref)`` on tokens sampled from ``pi`` (Schulman 2020).

    With ``x = log pi(y) - log pi_ref(y)``: ``k1 = x``; ``k2 = x**2 / 2``; ``k3 = expm1(-x) + x``
    (DeepSeekMath eq. 4); ``low_var_kl = clamp(k3, -10, 10)``.  Masked tokens give 0.

    Raises:
        ValueError: unknown ``kl_type`` (the message lists the valid ones) or shapes differ.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown KL estimator {kl_type!r} (--kl-loss-type); valid: {', '.join(KL_TYPES)}")
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    log_ratio = _float(log_probs) - _float(ref_log_probs)
    if loss_mask is not None:
        _check_same_shape(log_probs=log_probs, loss_mask=loss_mask)
        log_ratio = torch.where(loss_mask.bool(), log_ratio, 0.0)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.expm1(-log_ratio) + log_ratio
    if kl_type == "low_var_kl":
        return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return k3


# --- aggregation ----------------------------------------------------------------------


def aggregate_loss(
    values: Tensor,
    loss_mask: Tensor,
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    per_token: bool = False,
    global_normalizer: float | None = None,
    sample_token_counts: Tensor | None = None,
) -> Tensor:
    """Reduce per-token values to one scalar: sample-mean (default, DeepSeekMath eq. 3) or token-mean.

    Sample-mean: ``sum_s [sum_{t in s} m_t v_t / n_s] / N`` (``n_s`` the sample's masked tokens, or
    ``sample_token_counts``; ``N`` the samples); ``per_token``: ``sum_t m_t v_t / N`` (``N`` the masked
    tokens).  ``global_normalizer`` is ``N`` of the whole optimizer step (default: this call's).

    Returns:
        0-d tensor of ``values``' float dtype (differentiable).

    Raises:
        ValueError: shapes differ, malformed ``cu_seqlens``, unmasked tokens after
            ``cu_seqlens[-1]``, ``global_normalizer <= 0`` or a wrong ``sample_token_counts`` shape.
    """
    _check_same_shape(values=values, loss_mask=loss_mask)
    if global_normalizer is not None and not global_normalizer > 0:
        raise ValueError(f"global_normalizer must be > 0 (samples or tokens of the step), got {global_normalizer}")
    mask = loss_mask.bool()
    masked = torch.where(mask, _float(values), 0.0)
    if per_token:
        return masked.sum() / (global_normalizer or mask.sum().clamp(min=1))
    sums, counts = per_sample_sums(masked, mask, cu_seqlens)
    if sample_token_counts is not None:
        if tuple(sample_token_counts.shape) != tuple(sums.shape):
            raise ValueError(
                f"sample_token_counts must have one entry per sample, shape {tuple(sums.shape)}, "
                f"got {tuple(sample_token_counts.shape)}"
            )
        counts = sample_token_counts.to(sums.device)
    per_sample = sums / counts.clamp(min=1)
    return per_sample.sum() / (global_normalizer or max(per_sample.numel(), 1))


# --- the loss -------------------------------------------------------------------------


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: GRPOConfig,
    *,
    ref_log_probs: Tensor | None = None,
    rollout_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    global_normalizer: float | None = None,
    sample_token_counts: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``pg_loss + kl_loss_coef * kl_loss - entropy_coef * entropy``, each term :func:`aggregate_loss`-reduced.

    The per-token policy loss (GSPO's sequence ratio with ``--advantage-estimator gspo``) is multiplied by the IS
    weight (``--use-tis``, :func:`slime.grpo.correction.importance_weights`) and by OPSM's mask (``--use-opsm``,
    :func:`slime.grpo.correction.opsm_keep`), both from ``rollout_log_probs`` (the engine's); weighted or masked
    tokens still count in the normaliser (as upstream).  ``kl_loss`` when ``cfg.use_kl_loss`` and ``ref_log_probs``
    is given; ``entropy`` when given.

    Returns:
        ``(loss, metrics)``: a differentiable 0-d tensor, and detached 0-d tensors ``pg_loss``, ``pg_clipfrac``,
        ``ppo_kl`` (k1 of KL(pi_old || pi)), plus ``kl_loss`` and ``entropy`` when computed; with ``--use-tis``
        ``tis_weight_mean``, ``tis_clipfrac`` (aggregated like the loss) and ``tis_weight_min`` / ``_max`` (over
        this call's masked tokens; ``inf`` / ``-inf`` without any); with ``--use-opsm`` ``opsm_masked_frac``.

    Raises:
        ValueError: ``ref_log_probs``, ``rollout_log_probs`` or ``entropy`` missing where ``cfg`` needs it; errors
            of :func:`aggregate_loss` and :func:`slime.grpo.correction.importance_weights`.
    """
    if cfg.use_kl_loss and cfg.kl_loss_coef > 0 and ref_log_probs is None:
        raise ValueError(f"--use-kl-loss with --kl-loss-coef {cfg.kl_loss_coef} needs ref_log_probs, got None")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"--entropy-coef {cfg.entropy_coef} needs the per-token entropy, got None")
    if cfg.needs_rollout_log_probs and rollout_log_probs is None:
        raise ValueError("--use-tis / --use-opsm need rollout_log_probs (the rollout engine's), got None")

    def aggregate(values: Tensor) -> Tensor:
        return aggregate_loss(
            values,
            loss_mask,
            cu_seqlens=cu_seqlens,
            per_token=cfg.calculate_per_token_loss,
            global_normalizer=global_normalizer,
            sample_token_counts=sample_token_counts,
        )

    terms = compute_policy_loss(log_probs, old_log_probs, advantages, loss_mask, cfg.eps_clip, cfg.eps_clip_high,
                                sequence_level=cfg.gspo, cu_seqlens=cu_seqlens)
    pg_per_token = terms.loss
    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:  # weights and masks are detached: no gradient flows through them
        tis = importance_weights(old_log_probs, rollout_log_probs, loss_mask, cfg, cu_seqlens)
        pg_per_token = pg_per_token * tis.weights
        metrics["tis_weight_mean"] = aggregate(tis.weights)
        metrics["tis_weight_min"], metrics["tis_weight_max"] = masked_extrema(tis.weights, loss_mask)
        metrics["tis_clipfrac"] = aggregate(tis.changed)
    if cfg.use_opsm:
        keep = opsm_keep(log_probs, rollout_log_probs, advantages, loss_mask, cfg.opsm_delta, cu_seqlens)
        pg_per_token = pg_per_token * keep
        metrics["opsm_masked_frac"] = aggregate(1.0 - keep)
    loss = pg_loss = aggregate(pg_per_token)
    with torch.no_grad():
        metrics.update(pg_loss=pg_loss.detach(), pg_clipfrac=aggregate(terms.clipped), ppo_kl=aggregate(-terms.log_ratio))
    if cfg.use_kl_loss and ref_log_probs is not None:
        kl_loss = aggregate(compute_approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type, loss_mask))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if entropy is not None:
        mean_entropy = aggregate(entropy)
        loss = loss - cfg.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    return loss, metrics


def per_token_advantages(
    advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None = None
) -> Tensor:
    """Each sample's advantage ``[S]`` on each of its tokens, in ``loss_mask``'s shape (0 after ``cu_seqlens[-1]``).

    Raises:
        ValueError: ``advantages`` is not ``[S]``, or a malformed layout / ``cu_seqlens``.
    """
    try:
        return spread_per_sample(advantages, loss_mask, cu_seqlens)
    except ValueError as e:
        raise ValueError(f"advantages: {e}") from None


def loss_metric_names(cfg: GRPOConfig, with_kl_loss: bool) -> tuple[list[str], list[str]]:
    """The metrics :func:`grpo_micro_batch_loss` reports, as ``(summed over micro-batches and ranks, extremes)``:
    ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``entropy``, with ``--use-tis`` ``tis_weight_mean`` and
    ``tis_clipfrac`` (extremes ``tis_weight_min`` / ``_max``), with ``--use-opsm`` ``opsm_masked_frac``, and
    ``kl_loss`` with ``--use-kl-loss`` when ``with_kl_loss`` (a reference model exists)."""
    terms = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy"]
    terms += ["tis_weight_mean", "tis_clipfrac"] if cfg.use_tis else []
    terms += ["opsm_masked_frac"] if cfg.use_opsm else []
    terms += ["kl_loss"] if cfg.use_kl_loss and with_kl_loss else []
    return terms, ["tis_weight_min", "tis_weight_max"] if cfg.use_tis else []


def grpo_micro_batch_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: GRPOConfig,
    *,
    global_normalizer: float | None,
    ref_log_probs: Tensor | None = None,
    rollout_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    sample_token_counts: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's GRPO loss, from per-sample advantages ``[S]``.

    Spreads the advantages over the tokens, applies ``--kl-coef`` shaping, then :func:`grpo_loss`.  With
    ``global_normalizer`` over all DP ranks, the losses summed over micro-batches and ranks are the
    step's mean; a wrapper that averages gradients over ranks needs the loss scaled back by them.

    Returns:
        ``(loss, metrics)`` of :func:`grpo_loss`.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref_log_probs``, a wrong ``advantages`` shape, or any
            error of :func:`grpo_loss`.
    """
    token_advantages = per_token_advantages(advantages, loss_mask, cu_seqlens)
    if cfg.kl_coef > 0:
        if ref_log_probs is None:
            raise ValueError(f"--kl-coef {cfg.kl_coef} needs ref_log_probs (the reference model's), got None")
        token_advantages = apply_kl_penalty_to_advantages(
            token_advantages, old_log_probs, ref_log_probs, cfg.kl_coef, loss_mask
        )
    return grpo_loss(
        log_probs,
        old_log_probs,
        token_advantages,
        loss_mask,
        cfg,
        ref_log_probs=ref_log_probs,
        rollout_log_probs=rollout_log_probs,
        entropy=entropy,
        cu_seqlens=cu_seqlens,
        global_normalizer=global_normalizer,
        sample_token_counts=sample_token_counts,
    )

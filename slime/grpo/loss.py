"""The GRPO loss of one micro-batch: the policy loss (PPO's clip with clip-higher and dual clip, GSPO's or CISPO's),
KL, entropy, aggregation, and an optional custom reduction of the policy loss.

Pure torch, no model, no ``torch.distributed``; float32 (float64 kept).  A backend calls
:func:`grpo_micro_batch_loss` once per micro-batch.  Sources and departures from upstream:
``docs/design/grpo.md``.

Token layouts: every per-token tensor of one call has one shape, padded ``[B, T]`` (row = sample,
``loss_mask`` 0 on padding) or packed ``[T]`` with ``cu_seqlens`` (int ``[S + 1]``, from 0,
non-decreasing; tokens after ``cu_seqlens[-1]`` must be masked; without it, one sample).  Masked
tokens never enter the arithmetic, so padding may hold garbage.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from slime.grpo.config import KL_TYPES, MISMATCH_METRICS, PG_LOSS_REDUCERS, GRPOConfig, PGLossReducer
from slime.grpo.correction import rollout_correction
from slime.grpo.layout import as_float as _float
from slime.grpo.layout import check_layout, num_samples, per_sample_sums, sequence_sums
from slime.grpo.layout import check_same_shape as _check_same_shape
from slime.grpo.token_advantages import Whitening, token_advantages
from slime.utils.config import ConfigError
from slime.utils.registry import check_function

LOW_VAR_KL_BOUND = 10.0
"""``low_var_kl`` is k3 clamped to ``[-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND]`` (upstream slime / verl)."""


# --- per-token terms ----------------------------------------------------------------


class PolicyLossTerms(NamedTuple):
    """Per-token outputs of :func:`compute_policy_loss`, all 0 at masked-out tokens."""

    loss: Tensor
    """Clipped surrogate loss per token (to be minimised)."""
    clipped: Tensor
    """1.0 where the clipped branch is active (strictly larger), else 0.0."""
    log_ratio: Tensor
    """``log pi(y_t) - log pi_old(y_t)`` in nats; ``-log_ratio`` is the k1 estimate of KL(pi_old || pi)."""


def gspo_log_ratio(
    log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | Sequence[int] | None = None
) -> Tensor:
    """GSPO's sequence ratio in log space (Zheng et al. 2025, arXiv:2507.18071, eq. 7): each sample's mean of
    ``log pi(y_t) - log pi_old(y_t)`` over its masked tokens, on each of them (0 elsewhere); differentiable, so
    ``exp`` of it is the geometric mean of the token ratios with the paper's gradient."""
    mask = loss_mask.bool()
    diff = torch.where(mask, _float(log_probs) - _float(old_log_probs), 0.0)
    return torch.where(mask, sequence_sums(diff, mask, cu_seqlens, mean=True), 0.0)


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    *,
    eps_clip_c: float | None = None,
    sequence_level: bool = False,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate with clip-higher, per token (Schulman et al. 2017 eq. 7, negated; DAPO Sec. 3.1).

    ``loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_high))``, ``r_t = exp(log_probs -
    old_log_probs)``; with ``eps_clip_c`` (dual-clip PPO, Ye et al. 2019, arXiv:1912.09729 eq. 5; upstream
    ``compute_policy_loss``) a token with ``A_t < 0`` takes ``min(loss_t, -A_t eps_clip_c)``; with ``sequence_level``
    (GSPO), ``r_t`` is its sample's geometric mean of the token ratios (:func:`gspo_log_ratio`,
    layout ``cu_seqlens``).  All inputs one shape (log-probs in nats); float32 (float64 kept) outputs; ``clipped``
    counts the clip of eq. 7 only (as upstream's ``pg_clipfrac``).

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
    loss = torch.maximum(unclipped_loss, clipped_loss)
    if eps_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * eps_clip_c), loss)
    return PolicyLossTerms(loss=loss, clipped=(clipped_loss > unclipped_loss).to(ratio.dtype), log_ratio=log_ratio)


def compute_cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossTerms:
    """CISPO's loss per token (MiniMax-M1, arXiv:2506.13585, eq. 4-5; upstream ``compute_cispo_loss``):
    ``loss_t = -sg(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) A_t log pi(y_t)``, ``r_t = exp(log_probs -
    old_log_probs)``: the ratio is clipped under a stop-gradient and every token keeps the gradient ``-r A grad log pi``
    (the paper drops the lower bound: ``--eps-clip 1``).  ``clipped`` is 1.0 where the clip changed the ratio.  Inputs
    and outputs as :func:`compute_policy_loss`.

    Raises:
        ValueError: shapes differ.
    """
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.bool()
    log_prob = torch.where(mask, _float(log_probs), 0.0)
    log_ratio = torch.where(mask, _float(log_probs) - _float(old_log_probs), 0.0)
    ratio = log_ratio.exp()
    truncated = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high).detach()
    loss = -truncated * torch.where(mask, _float(advantages), 0.0) * log_prob
    return PolicyLossTerms(loss=loss, clipped=(truncated != ratio.detach()).to(ratio.dtype), log_ratio=log_ratio)


def compute_approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, kl_type: str, loss_mask: Tensor | None = None,
    importance_ratio: Tensor | None = None,
) -> Tensor:
    """Per-token estimate (nats) of ``KL(pi || pi_ref)`` on tokens sampled from ``pi`` (Schulman 2020).

    With ``x = log pi(y) - log pi_ref(y)``: ``k1 = x``; ``k2 = x**2 / 2``; ``k3 = expm1(-x) + x``
    (DeepSeekMath eq. 4); ``low_var_kl = clamp(k3, -10, 10)``.  ``importance_ratio`` (``--use-unbiased-kl``: the
    token's ``pi / pi_old``, DeepSeek-V3.2's unbiased KL; upstream ``compute_approx_kl``) multiplies the estimate
    before ``low_var_kl``'s clamp, as upstream.  Masked tokens give 0.

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
        kl = log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    if importance_ratio is not None:
        _check_same_shape(log_probs=log_probs, importance_ratio=importance_ratio)
        kl = kl * importance_ratio
    return kl.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND) if kl_type == "low_var_kl" else kl


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

    The per-token policy loss (GSPO's sequence ratio with ``--advantage-estimator gspo``, CISPO's loss with ``cispo``,
    dual-clip with ``--eps-clip-c``) is multiplied by the IS weight (``--use-tis``) and by OPSM's mask
    (``--use-opsm``), both from ``rollout_log_probs`` (the engine's: :func:`slime.grpo.correction.rollout_correction`),
    then reduced by
    ``--custom-pg-loss-reducer-function-path`` if set.  A token whose IS weight is 0 (rejected: ``icepop`` /
    ``reject`` outside the bounds) also leaves ``pg_clipfrac``, ``ppo_kl``, the KL loss and the entropy bonus, as
    upstream's rejection masks do; weighted, masked or rejected tokens still count in the normaliser (as upstream).
    ``kl_loss`` when ``cfg.use_kl_loss`` and ``ref_log_probs`` is given; ``entropy`` when given.

    Returns:
        ``(loss, metrics)``: a differentiable 0-d tensor, and detached 0-d tensors ``pg_loss``, ``pg_clipfrac``,
        ``ppo_kl`` (k1 of KL(pi_old || pi)), plus ``kl_loss`` and ``entropy`` when computed; with ``--use-tis``
        ``tis_weight_mean``, ``tis_clipfrac`` (aggregated like the loss) and ``tis_weight_min`` / ``_max`` (over
        this call's masked tokens; ``inf`` / ``-inf`` without any); with ``--use-opsm`` ``opsm_masked_frac``; with
        ``--get-mismatch-metrics`` the ``mis_*`` metrics (:func:`slime.grpo.correction.mismatch_metrics`).

    Raises:
        ValueError: ``ref_log_probs``, ``rollout_log_probs`` or ``entropy`` missing where ``cfg`` needs it; errors
            of :func:`aggregate_loss` and :func:`slime.grpo.correction.importance_weights`.
        ConfigError: the ``--custom-pg-loss-reducer-function-path`` function fails its contract.
    """
    if cfg.use_kl_loss and cfg.kl_loss_coef > 0 and ref_log_probs is None:
        raise ValueError(f"--use-kl-loss with --kl-loss-coef {cfg.kl_loss_coef} needs ref_log_probs, got None")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"--entropy-coef {cfg.entropy_coef} needs the per-token entropy, got None")
    if cfg.needs_rollout_log_probs and rollout_log_probs is None:
        raise ValueError("--use-tis / --use-opsm / --get-mismatch-metrics need rollout_log_probs (the rollout "
                         "engine's), got None")

    def aggregate(values: Tensor) -> Tensor:
        return aggregate_loss(
            values,
            loss_mask,
            cu_seqlens=cu_seqlens,
            per_token=cfg.calculate_per_token_loss,
            global_normalizer=global_normalizer,
            sample_token_counts=sample_token_counts,
        )

    if cfg.cispo:
        terms = compute_cispo_loss(log_probs, old_log_probs, advantages, loss_mask, cfg.eps_clip, cfg.eps_clip_high)
    else:
        terms = compute_policy_loss(log_probs, old_log_probs, advantages, loss_mask, cfg.eps_clip, cfg.eps_clip_high,
                                    eps_clip_c=cfg.eps_clip_c, sequence_level=cfg.gspo, cu_seqlens=cu_seqlens)
    pg_per_token, kept, metrics = rollout_correction(terms.loss, log_probs, old_log_probs, rollout_log_probs,
                                                     advantages, loss_mask, cfg, cu_seqlens, aggregate)

    def aggregate_kept(values: Tensor) -> Tensor:
        return aggregate(torch.where(kept, values, 0.0))

    if cfg.custom_pg_loss_reducer_function_path is None:
        loss = pg_loss = aggregate(pg_per_token)
    else:
        if sample_token_counts is not None:
            raise ValueError("--custom-pg-loss-reducer-function-path needs whole samples in one call; "
                             "sample_token_counts (context parallelism) is not supported with it")
        normalizer = global_normalizer or _call_normalizer(loss_mask, cu_seqlens, cfg.calculate_per_token_loss)
        loss = pg_loss = _custom_pg_loss(pg_per_token, kept, cu_seqlens, cfg) / normalizer
    with torch.no_grad():
        metrics.update(pg_loss=pg_loss.detach(), pg_clipfrac=aggregate_kept(terms.clipped),
                       ppo_kl=aggregate_kept(-terms.log_ratio))
    if cfg.use_kl_loss and ref_log_probs is not None:
        ratio = None
        if cfg.use_unbiased_kl:  # the token ratio pi / pi_old, differentiable (upstream), GSPO's too
            ratio = torch.where(loss_mask.bool(), _float(log_probs) - _float(old_log_probs), 0.0).exp()
        kl_loss = aggregate_kept(compute_approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type, loss_mask, ratio))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if entropy is not None:
        mean_entropy = aggregate_kept(entropy)
        loss = loss - cfg.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    return loss, metrics


def _call_normalizer(loss_mask: Tensor, cu_seqlens, per_token: bool) -> float:
    """:func:`aggregate_loss`'s default ``N``: this call's samples, or its loss-masked tokens (at least 1)."""
    if per_token:
        return max(int(loss_mask.bool().sum()), 1)
    return max(num_samples(loss_mask, cu_seqlens), 1)


def pg_loss_reducer(cfg: GRPOConfig) -> PGLossReducer:
    """The ``--custom-pg-loss-reducer-function-path`` function of ``cfg``, imported and checked (the driver calls it
    before Ray starts; cached per path).

    Raises:
        ConfigError: naming the flag: the path is unset, cannot be imported, or the object is not a function of
            ``(token_losses, cfg)``.
    """
    if cfg.custom_pg_loss_reducer_function_path is None:
        raise ConfigError("--custom-pg-loss-reducer-function-path is not set")
    return _checked_reducer(cfg.custom_pg_loss_reducer_function_path)


@functools.lru_cache(maxsize=None)
def _checked_reducer(path: str) -> PGLossReducer:
    fn = PG_LOSS_REDUCERS.resolve(path)
    check_function(fn, PG_LOSS_REDUCERS.flag, path, ([torch.zeros(1)], None), "a policy-loss reducer must accept "
                   "(token_losses: list[Tensor], cfg: GRPOConfig) and return a 0-d Tensor")
    return fn


def _custom_pg_loss(pg_per_token: Tensor, kept: Tensor, cu_seqlens, cfg: GRPOConfig) -> Tensor:
    """The custom reducer's sum over this call's samples (each sample's kept tokens, in order)."""
    cu = check_layout(pg_per_token, cu_seqlens)
    if pg_per_token.dim() == 2:
        token_losses = [row[on] for row, on in zip(pg_per_token, kept)]
    elif cu is None:
        token_losses = [pg_per_token[kept]]
    else:
        bounds = cu.tolist()
        token_losses = [pg_per_token[a:b][kept[a:b]] for a, b in zip(bounds, bounds[1:])]
    out = pg_loss_reducer(cfg)(token_losses, cfg)
    if not isinstance(out, Tensor) or out.dim() != 0:
        raise ConfigError(f"{PG_LOSS_REDUCERS.flag} {cfg.custom_pg_loss_reducer_function_path} returned "
                          f"{type(out).__name__} {getattr(out, 'shape', '')}; a reducer returns a 0-d Tensor")
    return out


def loss_metric_names(cfg: GRPOConfig, with_kl_loss: bool) -> tuple[list[str], list[str]]:
    """The metrics :func:`grpo_micro_batch_loss` reports, as ``(summed over micro-batches and ranks, extremes)``:
    ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``entropy``, with ``--use-tis`` ``tis_weight_mean`` and
    ``tis_clipfrac`` (extremes ``tis_weight_min`` / ``_max``), with ``--use-opsm`` ``opsm_masked_frac``, with
    ``--get-mismatch-metrics`` the ``mis_*`` metrics (:data:`slime.grpo.config.MISMATCH_METRICS`), and ``kl_loss``
    with ``--use-kl-loss`` when ``with_kl_loss`` (a reference model exists)."""
    terms = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy"]
    terms += ["tis_weight_mean", "tis_clipfrac"] if cfg.use_tis else []
    terms += ["opsm_masked_frac"] if cfg.use_opsm else []
    terms += list(MISMATCH_METRICS) if cfg.get_mismatch_metrics else []
    terms += ["kl_loss"] if cfg.use_kl_loss and with_kl_loss else []
    return terms, ["tis_weight_min", "tis_weight_max"] if cfg.use_tis else []


def grpo_micro_batch_loss(
    log_probs: Tensor,
    old_log_probs: Tensor | None,
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
    advantage_whitening: Whitening | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's GRPO loss, from per-sample advantages ``[S]``.

    ``old_log_probs`` None (``--skip-actor-forward-only``, one optimizer step per rollout): the old policy is
    the current one, so the old log-probs are ``log_probs.detach()``: every ratio is exactly 1 and the gradient is
    PPO's at its first update (Schulman et al. 2017, arXiv:1707.06347, eq. 7 at ``theta = theta_old``).

    Turns them into per-token advantages (:func:`slime.grpo.token_advantages.token_advantages`: ``--kl-coef`` shaping,
    REINFORCE++'s returns), whitens them with ``advantage_whitening`` (``--normalize-advantages``: the rollout step's
    statistics), then :func:`grpo_loss`.  With ``global_normalizer`` over all DP ranks, the losses summed over
    micro-batches and ranks are the step's mean; a wrapper that averages gradients over ranks needs the loss scaled
    back by them.

    Returns:
        ``(loss, metrics)`` of :func:`grpo_loss`.

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref_log_probs``, ``--normalize-advantages`` without
            ``advantage_whitening``, a wrong ``advantages`` shape, or any error of :func:`grpo_loss`.
    """
    if cfg.normalize_advantages and advantage_whitening is None:
        raise ValueError("--normalize-advantages needs the rollout step's advantage_whitening, got None")
    if old_log_probs is None:
        old_log_probs = log_probs.detach()
    token_adv = token_advantages(advantages, loss_mask, cfg, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                                 cu_seqlens=cu_seqlens, whitening=advantage_whitening if cfg.normalize_advantages
                                 else None)
    return grpo_loss(
        log_probs,
        old_log_probs,
        token_adv,
        loss_mask,
        cfg,
        ref_log_probs=ref_log_probs,
        rollout_log_probs=rollout_log_probs,
        entropy=entropy,
        cu_seqlens=cu_seqlens,
        global_normalizer=global_normalizer,
        sample_token_counts=sample_token_counts,
    )

"""Off-policy corrections of the GRPO policy loss for the rollout engine's sampling, in one call
(:func:`rollout_correction`): importance-sampling weights, OPSM, and the train/rollout mismatch metrics.

Pure torch, layouts of :mod:`slime.grpo.loss` (padded ``[B, T]``, or packed ``[T]`` with ``cu_seqlens``); log-probs
in nats; float32 (float64 kept).  The weighting functions of ``--tis-mode`` are registered in
:data:`slime.grpo.config.TIS_FUNCTIONS`.  Sources, upstream names and departures: ``docs/design/grpo.md``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from slime.grpo.config import TIS_LEVELS, GRPOConfig, TISFunction, TIS_FUNCTIONS
from slime.grpo.layout import as_float, check_same_shape, log_ratio, sequence_sums
from slime.utils.config import ConfigError
from slime.utils.registry import check_function

SAFETY_BOUND = 20.0
"""The level's log-ratio is clamped to ``[-SAFETY_BOUND, SAFETY_BOUND]`` before ``exp`` (upstream ``mis.py``)."""


def rollout_correction(
    pg_per_token: Tensor, log_probs: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor | None,
    advantages: Tensor, loss_mask: Tensor, cfg: GRPOConfig, cu_seqlens: Tensor | Sequence[int] | None,
    aggregate: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The corrections for the rollout engine's sampling that ``cfg`` turns on, applied to the per-token policy loss
    ``pg_per_token`` (all tensors one shape, layout ``cu_seqlens``): the IS weight (``--use-tis``,
    :func:`importance_weights`) and OPSM's mask (``--use-opsm``, :func:`opsm_keep`) multiply it; their metrics and
    the ``mis_*`` ones (``--get-mismatch-metrics``, :func:`mismatch_metrics`) are reduced by ``aggregate`` (the
    loss's reduction of a per-token tensor to a 0-d one).  Weights and masks are detached: no gradient flows
    through them.

    Returns:
        ``(pg_per_token, kept, metrics)``: the corrected loss; bool ``kept``, the loss-masked tokens IS did not reject
        (weight 0: ``icepop`` / ``reject`` outside the bounds); ``tis_weight_mean``, ``tis_clipfrac``,
        ``tis_weight_min`` / ``_max`` (:func:`masked_extrema`), ``opsm_masked_frac`` and the ``mis_*`` metrics, each
        where its flag is on.

    Raises:
        ValueError: shapes differ, or a malformed layout.
        ConfigError: the IS weighting function fails its contract (:func:`importance_weights`).
    """
    kept = loss_mask.bool()
    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:
        tis = importance_weights(old_log_probs, rollout_log_probs, loss_mask, cfg, cu_seqlens)
        pg_per_token = pg_per_token * tis.weights
        kept = kept & (tis.weights > 0)
        metrics["tis_weight_mean"] = aggregate(tis.weights)
        metrics["tis_weight_min"], metrics["tis_weight_max"] = masked_extrema(tis.weights, loss_mask)
        metrics["tis_clipfrac"] = aggregate(tis.changed)
    if cfg.use_opsm:
        keep = opsm_keep(log_probs, rollout_log_probs, advantages, loss_mask, cfg.opsm_delta, cu_seqlens)
        pg_per_token = pg_per_token * keep
        metrics["opsm_masked_frac"] = aggregate(1.0 - keep)
    if cfg.get_mismatch_metrics:
        with torch.no_grad():
            for name, values in mismatch_metrics(old_log_probs, rollout_log_probs, loss_mask, cu_seqlens).items():
                metrics[name] = aggregate(values)
    return pg_per_token, kept, metrics


# --- the weighting functions of --tis-mode: (ratio, cfg) -> weights, elementwise -------------------


def truncate(ratio: Tensor, cfg: GRPOConfig) -> Tensor:
    """Truncated IS (Yao et al. 2025, https://fengyao.notion.site/off-policy-rl): ``clamp(ratio, low, high)``."""
    return ratio.clamp(cfg.tis_clip_low, cfg.tis_clip)


def icepop(ratio: Tensor, cfg: GRPOConfig) -> Tensor:
    """IcePop / masked IS (Ling team 2025, Ring-1T; upstream ``icepop_function``): the ratio inside ``[low, high]``,
    0 outside."""
    return torch.where((ratio >= cfg.tis_clip_low) & (ratio <= cfg.tis_clip), ratio, 0.0)


def reject(ratio: Tensor, cfg: GRPOConfig) -> Tensor:
    """Rejection sampling (verl's ``rollout_rs``): 1 inside ``[low, high]``, 0 outside; no reweighting."""
    return ((ratio >= cfg.tis_clip_low) & (ratio <= cfg.tis_clip)).to(ratio.dtype)


def tis_function(cfg: GRPOConfig) -> TISFunction:
    """The weighting function of ``cfg``: ``--custom-tis-function-path`` if set, else ``--tis-mode`` (the driver
    calls it before Ray starts).

    Raises:
        ConfigError: naming the flag: the entry cannot be imported (:meth:`Registry.resolve`) or is not a function of
            ``(ratio, cfg)`` (:func:`~slime.utils.registry.check_function`).
    """
    return _checked_tis_function(*_tis_flag(cfg))


@functools.lru_cache(maxsize=None)
def _checked_tis_function(flag: str, name: str) -> TISFunction:
    """:func:`tis_function`'s lookup and signature check, once per ``(flag, name)`` (the loss asks every micro-batch;
    a failure is not cached)."""
    fn = TIS_FUNCTIONS.resolve(name, flag)
    check_function(fn, flag, name, (torch.ones(1), None), "an IS weighting function must accept (ratio: Tensor, "
                   "cfg: GRPOConfig) and return weights of ratio's shape")
    return fn


def _tis_flag(cfg: GRPOConfig) -> tuple[str, str]:
    """``(flag, value)`` that chose the weighting function, for messages."""
    if cfg.custom_tis_function_path:
        return "--custom-tis-function-path", cfg.custom_tis_function_path
    return "--tis-mode", cfg.tis_mode


# --- IS weights ------------------------------------------------------------------------------------


class ISWeights(NamedTuple):
    """Per-token outputs of :func:`importance_weights`, detached, 0 at masked-out tokens."""

    weights: Tensor
    """The factor on each token's policy loss (>= 0)."""
    changed: Tensor
    """1.0 where the weight differs from the level's ratio (clipped, zeroed or rejected), else 0.0."""


def level_log_ratio(
    old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, level: str,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """``log pi_old(y_t) - log pi_rollout(y_t)`` at ``level``: ``token`` (each token's), ``sequence`` (its sample's
    sum over masked tokens), ``geometric`` (that sum / the sample's masked tokens); clamped to
    ``[-SAFETY_BOUND, SAFETY_BOUND]``, 0 at masked-out tokens.

    Raises:
        ValueError: unknown ``level``, shapes differ, or a malformed layout.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown IS level {level!r} (--tis-level); valid: {', '.join(TIS_LEVELS)}")
    mask = loss_mask.bool()
    diff = log_ratio(old_log_probs, rollout_log_probs, loss_mask)
    if level != "token":
        diff = sequence_sums(diff, mask, cu_seqlens, mean=level == "geometric")
    return torch.where(mask, diff.clamp(-SAFETY_BOUND, SAFETY_BOUND), 0.0)


def importance_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, cfg: GRPOConfig,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> ISWeights:
    """The IS weight of each token, ``f(exp(level_log_ratio))`` with ``f`` :func:`tis_function` (``--tis-mode`` or
    ``--custom-tis-function-path``) at ``--tis-level`` (:func:`level_log_ratio`); no gradient.

    Raises:
        ValueError: shapes differ, or a malformed layout.
        ConfigError: naming the flag of ``f``: it returned another shape or a negative / NaN weight.
    """
    mask = loss_mask.bool()
    with torch.no_grad():
        ratio = level_log_ratio(old_log_probs.detach(), rollout_log_probs, mask, cfg.tis_level, cu_seqlens).exp()
        weights = as_float(torch.as_tensor(tis_function(cfg)(ratio, cfg)))
        flag, name = _tis_flag(cfg)
        if weights.shape != ratio.shape:
            raise ConfigError(f"{flag} {name} returned shape {tuple(weights.shape)} for ratios of shape "
                              f"{tuple(ratio.shape)}; an IS weighting function must be elementwise")
        weights = torch.where(mask, weights, 0.0)
        if not bool((weights >= 0).all()):  # False for NaN too
            raise ConfigError(f"{flag} {name} returned a negative or NaN weight; IS weights must be >= 0")
        changed = (mask & (weights != ratio)).to(weights.dtype)
    return ISWeights(weights, changed)


def masked_extrema(values: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Detached 0-d ``(min, max)`` of ``values`` over masked tokens; ``(inf, -inf)`` when there are none (the
    neutral elements of the reduction over micro-batches and ranks)."""
    v = values.detach()
    if v.numel() == 0:
        return v.new_tensor(torch.inf), v.new_tensor(-torch.inf)
    mask = loss_mask.bool()
    return torch.where(mask, v, torch.inf).amin(), torch.where(mask, v, -torch.inf).amax()


# --- OPSM ---------------------------------------------------------------------------------


def opsm_keep(
    log_probs: Tensor, rollout_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, delta: float,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, eq. 9; upstream ``compute_opsm_mask``): 0.0 on
    every token with a negative advantage ``A_t`` in a sample whose ``KL(pi_rollout || pi)``, estimated as the mean of
    ``log pi_rollout - log pi`` over its masked tokens, exceeds ``delta`` (``--opsm-delta``); 1.0 elsewhere.  No
    gradient; ``advantages`` per token (the paper's ``A_{i,t}``: all of a GRPO sample's are equal, so the whole sample
    goes; REINFORCE++'s returns and ``--kl-coef`` shaping make them differ).

    Raises:
        ValueError: shapes differ, or a malformed layout.
    """
    check_same_shape(log_probs=log_probs, rollout_log_probs=rollout_log_probs, advantages=advantages,
                     loss_mask=loss_mask)
    mask = loss_mask.bool()
    with torch.no_grad():
        kl = sequence_sums(as_float(rollout_log_probs) - as_float(log_probs.detach()), mask, cu_seqlens, mean=True)
        return (~((advantages.detach() < 0) & (kl > delta))).to(kl.dtype)


# --- mismatch metrics (--get-mismatch-metrics) --------------------------------------------------------


def mismatch_metrics(
    old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """The train/rollout mismatch metrics of upstream's ``examples/train_infer_mismatch_helper/mis.py``
    (``add_ppl_metrics``), per token, detached, each to be aggregated like the loss.  With ``d_t = log pi_old(y_t) -
    log pi_rollout(y_t)``: ``mis_kl = -d_t`` and ``mis_k3_kl = exp(d_t) - 1 - d_t`` (k1 and k3 of KL(rollout ||
    trainer), Schulman 2020); ``mis_chi2_token``: the sample's mean of ``rho_t^2``, minus 1, and ``mis_chi2_seq``:
    ``(prod_t rho_t)^2 - 1`` (chi-squared divergence of the token and sequence ratios ``rho = exp(d)``, ``d`` and
    ``sum_t d_t`` clamped to ``[-SAFETY_BOUND, SAFETY_BOUND]``); ``mis_{training,rollout}_log_ppl``: minus the sample's
    mean log-prob, ``_ppl`` its ``exp``; ``mis_log_ppl_diff``: rollout's mean log-prob minus the trainer's,
    ``mis_log_ppl_abs_diff`` its absolute value, ``mis_ppl_ratio`` its ``exp``.  Per-sample values sit on each of the
    sample's tokens.

    Raises:
        ValueError: shapes differ, or a malformed layout.
    """
    check_same_shape(old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, loss_mask=loss_mask)
    mask = loss_mask.bool()
    with torch.no_grad():
        train = torch.where(mask, as_float(old_log_probs.detach()), 0.0)
        rollout = torch.where(mask, as_float(rollout_log_probs), 0.0)
        d = train - rollout
        mean_train = sequence_sums(train, mask, cu_seqlens, mean=True)
        mean_rollout = sequence_sums(rollout, mask, cu_seqlens, mean=True)
        rho_sq = (2 * d.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp()
        log_seq = sequence_sums(d, mask, cu_seqlens, mean=False).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        log_ppl_diff = mean_rollout - mean_train
        return {
            "mis_kl": -d, "mis_k3_kl": torch.expm1(d) - d,
            "mis_chi2_token": sequence_sums(rho_sq, mask, cu_seqlens, mean=True) - 1.0,
            "mis_chi2_seq": torch.expm1(2 * log_seq),
            "mis_training_log_ppl": -mean_train, "mis_training_ppl": (-mean_train).exp(),
            "mis_rollout_log_ppl": -mean_rollout, "mis_rollout_ppl": (-mean_rollout).exp(),
            "mis_log_ppl_diff": log_ppl_diff, "mis_log_ppl_abs_diff": log_ppl_diff.abs(),
            "mis_ppl_ratio": log_ppl_diff.exp(),
        }

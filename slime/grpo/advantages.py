"""Advantages: one per response, from the rewards of its prompt's group (the per-token stage:
:mod:`slime.grpo.token_advantages`).

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, Sec. 4.1), Dr.GRPO (Liu et al. 2025,
arXiv:2503.20783: no std division), GSPO and CISPO (GRPO's advantages; their own policy losses), REINFORCE++
(Hu 2025, arXiv:2501.03262: the raw reward) and its baseline variant (the group-centred reward), registered
in :data:`slime.grpo.config.ADVANTAGE_ESTIMATORS`.  ``--disable-rewards-normalization`` gives every group-relative
one the raw rewards (upstream slime's rule).
Departures from upstream (unbiased std, exact 0 for equal groups, a partial group raises):
``docs/design/grpo.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime.grpo.config import ADVANTAGE_ESTIMATORS, AdvantageEstimator, GRPOConfig, group_relative
from slime.utils.registry import check_function


def checked_rewards(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """``rewards`` ``[num_prompts * n]`` (any real or bool dtype) as float64, after the checks every estimator needs.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``n < 1``, its length is not a multiple of ``n``, or a
            reward is NaN / infinite.
    """
    n = n_samples_per_prompt
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * n_samples_per_prompt], got shape {tuple(rewards.shape)}")
    if n < 1:
        raise ValueError(f"n_samples_per_prompt (--n-samples-per-prompt) must be >= 1, got {n}")
    if rewards.numel() % n != 0:
        raise ValueError(
            f"{rewards.numel()} rewards is not a multiple of n_samples_per_prompt={n} "
            "(--n-samples-per-prompt): every prompt needs exactly n contiguous samples; "
            "check that no sample was dropped from the batch"
        )
    r = rewards.detach().to(torch.float64)
    non_finite = (~torch.isfinite(r)).nonzero()
    if non_finite.numel() > 0:
        i = int(non_finite[0])
        raise ValueError(f"reward of sample {i} (group {i // n}) is {r[i].item()}; rewards must be finite")
    return r


def compute_group_advantages(
    rewards: Tensor, n_samples_per_prompt: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantages ``A_i = (r_i - mean(g)) / (std(g) + eps)`` per group ``g`` (DeepSeekMath Sec. 4.1.2).

    ``rewards``: ``[num_prompts * n]`` (any real or bool dtype, a prompt's ``n`` samples contiguous) ->
    float32 ``[num_prompts * n]``.  Unbiased ``std``; no division when not ``normalize_std`` (Dr.GRPO);
    computed in float64; a group of equal rewards gets exactly 0.

    Raises:
        ValueError: see :func:`checked_rewards`.
    """
    n = n_samples_per_prompt
    groups = checked_rewards(rewards, n).view(-1, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and n > 1:
        centred = centred / (groups.std(dim=1, correction=1, keepdim=True) + eps)
    all_equal = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(all_equal, 0.0, centred).view(-1).to(torch.float32)


def _normalised(rewards: Tensor, group_size: int, cfg: GRPOConfig, normalize_std: bool) -> Tensor:
    """:func:`compute_group_advantages`, or the raw rewards (float32) with ``--disable-rewards-normalization``."""
    if cfg.disable_rewards_normalization:
        return checked_rewards(rewards, group_size).to(torch.float32)
    return compute_group_advantages(rewards, group_size, normalize_std=normalize_std)


@group_relative
def grpo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """GRPO advantages; no std division with ``--disable-grpo-std-normalization``."""
    return _normalised(rewards, group_size, cfg, normalize_std=not cfg.disable_grpo_std_normalization)


@group_relative
def dr_grpo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """Dr.GRPO advantages: group-centred rewards, never divided by the std."""
    return _normalised(rewards, group_size, cfg, normalize_std=False)


@group_relative
def gspo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """GSPO's advantages, GRPO's (Zheng et al. 2025, arXiv:2507.18071, eq. 6); the name also switches the policy loss
    to GSPO's sequence ratio (:func:`slime.grpo.loss.gspo_log_ratio`)."""
    return grpo(rewards, group_size, cfg)


@group_relative
def cispo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """CISPO's advantages, GRPO's (MiniMax-M1, arXiv:2506.13585, eq. 4-5, as upstream slime); the name also switches
    the policy loss to CISPO's (:func:`slime.grpo.loss.compute_cispo_loss`)."""
    return grpo(rewards, group_size, cfg)


def reinforce_plus_plus(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): the raw reward, never group-normalised (upstream slime); its per-token
    discounted return and the whitening follow in :func:`slime.grpo.token_advantages.token_advantages`."""
    return checked_rewards(rewards, group_size).to(torch.float32)


@group_relative
def reinforce_plus_plus_baseline(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """REINFORCE++-baseline (arXiv:2501.03262 v3; upstream slime): the reward minus its group's mean (no std), the
    whitening over the batch following in the per-token stage."""
    return _normalised(rewards, group_size, cfg, normalize_std=False)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name`` (or a ``package.module:attr`` path).

    Raises:
        KeyError: unknown name; the message lists the valid ones.
    """
    return ADVANTAGE_ESTIMATORS.get(name)


def resolve_advantage_estimator(cfg: GRPOConfig) -> AdvantageEstimator:
    """The ``--advantage-estimator`` of ``cfg``, imported and checked (the driver calls it before Ray starts).

    Raises:
        ConfigError: naming ``--advantage-estimator``: the module cannot be imported, has no such
            attribute, or the object is not a function of ``(rewards, group_size, cfg)``.
    """
    name = cfg.advantage_estimator
    estimator = ADVANTAGE_ESTIMATORS.resolve(name)
    check_function(estimator, "--advantage-estimator", name, (torch.zeros(1), 1, cfg), "an advantage estimator must "
                   "accept (rewards: Tensor, group_size: int, cfg: GRPOConfig) and return advantages")
    return estimator


def compute_advantages(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """Per-sample advantages ``[N]`` (float32) with the estimator ``cfg.advantage_estimator``."""
    return get_advantage_estimator(cfg.advantage_estimator)(rewards, group_size, cfg)

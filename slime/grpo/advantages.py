"""GRPO advantages: one per response, from the rewards of its prompt's group.

- GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, Sec. 4.1): each prompt is sampled
  ``n`` times; a response's advantage is its reward minus the group mean, divided by the
  group std, and is the same for every response token (outcome supervision).
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  arXiv:2503.20783): no division by the group std (estimator ``dr_grpo``, or
  ``--disable-grpo-std-normalization`` with ``grpo``).

Where it departs from upstream slime / verl:

- The group std is the unbiased one (Bessel, ``n - 1``), as ``torch.std`` upstream; the paper
  does not say.  ``eps = 1e-6`` is added to the std (upstream).
- A group whose rewards are all equal gets exactly 0 advantage (upstream leaves a rounding
  residue, e.g. for fp32 rewards of 0.9, which the std division then amplifies).
- A batch whose size is not a multiple of the group size raises (upstream slime silently
  normalises the whole batch as one group).

The estimators are registered by name in :data:`slime.grpo.config.ADVANTAGE_ESTIMATORS`.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from slime.grpo.config import ADVANTAGE_ESTIMATORS, AdvantageEstimator, GRPOConfig, group_relative
from slime.utils.config import ConfigError


def compute_group_advantages(
    rewards: Tensor, n_samples_per_prompt: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantages: ``A_i = (r_i - mean(g)) / (std(g) + eps)`` per group ``g``.

    Shao et al. 2024 (DeepSeekMath), Sec. 4.1.2; without the std division when
    ``normalize_std`` is False (Dr.GRPO, Liu et al. 2025).  ``std`` is the unbiased sample
    std (divides by ``n - 1``), as ``torch.std`` in upstream slime / verl.

    Rewards are promoted to float64 before any arithmetic.  A group whose rewards are all
    equal (``max == min``) gets exactly 0 for every member, whatever the value and dtype;
    this covers ``n_samples_per_prompt == 1``, where every advantage is 0.

    Args:
        rewards: ``[num_prompts * n_samples_per_prompt]``, any real or bool dtype; the
            ``n_samples_per_prompt`` samples of one prompt are contiguous.
        n_samples_per_prompt: group size ``n`` (``--n-samples-per-prompt``), >= 1.
        normalize_std: divide the centred rewards by ``std + eps``.
        eps: added to the std (reward units).

    Returns:
        float32 ``[num_prompts * n_samples_per_prompt]``, one advantage per sample.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``n_samples_per_prompt < 1``, its length is not a
            multiple of ``n_samples_per_prompt``, or a reward is NaN / infinite.
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
    groups = r.view(-1, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and n > 1:
        centred = centred / (groups.std(dim=1, correction=1, keepdim=True) + eps)
    all_equal = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(all_equal, 0.0, centred).view(-1).to(torch.float32)


@group_relative
def grpo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """GRPO advantages (:func:`compute_group_advantages`); no std division with ``--disable-grpo-std-normalization``."""
    return compute_group_advantages(rewards, group_size, normalize_std=not cfg.disable_grpo_std_normalization)


@group_relative
def dr_grpo(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """Dr.GRPO advantages (Liu et al. 2025): group-centred rewards, never divided by the std."""
    return compute_group_advantages(rewards, group_size, normalize_std=False)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name`` (or a ``package.module:attr`` path).

    Raises:
        KeyError: unknown name; the message lists the valid ones.
    """
    return ADVANTAGE_ESTIMATORS.get(name)


def resolve_advantage_estimator(cfg: GRPOConfig) -> AdvantageEstimator:
    """The ``--advantage-estimator`` of ``cfg``, imported and checked; the driver calls it before Ray starts.

    :class:`GRPOConfig` checks only the form of an import path; this imports it (through
    :meth:`slime.utils.registry.Registry.resolve`) and checks that it accepts ``(rewards,
    group_size, cfg)``.

    Raises:
        ConfigError: naming ``--advantage-estimator``: the module cannot be imported, has no such
            attribute, or the object is not a function of ``(rewards, group_size, cfg)``.
    """
    name = cfg.advantage_estimator
    estimator = ADVANTAGE_ESTIMATORS.resolve(name)
    if not callable(estimator):
        raise ConfigError(f"--advantage-estimator {name!r} is a {type(estimator).__name__}, not a function")
    try:
        inspect.signature(estimator).bind(torch.zeros(1), 1, cfg)
    except TypeError:
        raise ConfigError(
            f"--advantage-estimator {name!r} has the signature {inspect.signature(estimator)}; an advantage "
            "estimator must accept (rewards: Tensor, group_size: int, cfg: GRPOConfig) and return advantages"
        ) from None
    except ValueError:  # no signature available (some builtins): accept it and let calls fail
        pass
    return estimator


def compute_advantages(rewards: Tensor, group_size: int, cfg: GRPOConfig) -> Tensor:
    """Per-sample advantages ``[N]`` (float32) with the estimator ``cfg.advantage_estimator``."""
    return get_advantage_estimator(cfg.advantage_estimator)(rewards, group_size, cfg)

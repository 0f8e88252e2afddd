"""GRPO flags (GRPO_ARGS) and the advantage-estimator registry, importable without torch.

The built-in estimators (:mod:`slime.grpo.advantages`) are declared by import path, so checking
``--advantage-estimator`` at parse time imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from slime.utils.config import ConfigError, flag
from slime.utils.registry import Builtin, Registry

if TYPE_CHECKING:
    from torch import Tensor

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
"""The KL estimators of ``--kl-loss-type`` (:func:`slime.grpo.loss.compute_approx_kl`)."""


@dataclasses.dataclass
class GRPOConfig:
    """GRPO (GRPO_ARGS): advantages, clipped policy loss, KL and entropy terms."""

    advantage_estimator: str = flag("grpo", help="Advantage estimator (registered name).")
    disable_grpo_std_normalization: bool = flag(
        False, help="Do not divide group-centred rewards by the group std (Dr.GRPO, Liu et al. 2025)."
    )
    use_kl_loss: bool = flag(False, help="Add a KL(policy || reference) term to the loss (needs a reference model).")
    kl_loss_coef: float = flag(0.0, help="Weight of the KL loss term; > 0 requires a reference model.")
    kl_loss_type: str = flag(
        "low_var_kl", choices=list(KL_TYPES), help="KL estimator for the KL loss (Schulman 2020)."
    )
    kl_coef: float = flag(0.0, help="KL penalty folded into the per-token advantage (reward shaping, k1 estimator).")
    entropy_coef: float = flag(0.0, help="Weight of the entropy bonus (subtracted from the loss).")
    eps_clip: float = flag(0.2, help="Lower PPO clip range: ratio >= 1 - eps_clip.")
    eps_clip_high: float | None = flag(None, help="Upper PPO clip range (DAPO clip-higher); default: --eps-clip.")
    calculate_per_token_loss: bool = flag(
        False, help="Average the loss over all tokens of the batch instead of per sample first (the default)."
    )
    stop_properly_penalty_coef: float | None = flag(
        None,
        help="Multiply the reward of every truncated training sample (cut at --rollout-max-response-len) by this "
        "factor in [0, 1] before advantages; 0 zeroes it (ProRL's stop-properly penalty, OpenRLHF's flag). "
        "Default: truncated samples keep their reward, so one that already holds a correct box scores 1 "
        "(upstream slime). Eval is never shaped.",
    )
    overlong_filter: bool = flag(
        False,
        help="Mask truncated training samples out of the loss (DAPO's overlong filtering): loss mask 0 on every "
        "token, so they give no gradient; their rewards still enter their group's mean and std.",
    )

    def __post_init__(self):
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        for name in ("eps_clip", "eps_clip_high", "kl_loss_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.kl_loss_type not in KL_TYPES:
            raise ConfigError(f"--kl-loss-type {self.kl_loss_type!r} is unknown; choose one of {', '.join(KL_TYPES)}")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise ConfigError(
                f"--kl-loss-coef {self.kl_loss_coef} has no effect without --use-kl-loss; "
                "add --use-kl-loss or set --kl-loss-coef 0"
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and not 0 <= coef <= 1:
            raise ConfigError(
                f"--stop-properly-penalty-coef must be in [0, 1] (a factor on truncated samples' rewards), got {coef}; "
                "use 0 to zero them, or leave it unset to keep their rewards"
            )
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"--advantage-estimator {self.advantage_estimator!r} is unknown; "
                f"choose one of {', '.join(ADVANTAGE_ESTIMATORS.names())} or a 'package.module:attr' path"
            )

    @property
    def needs_ref_model(self) -> bool:
        """A reference model exists only when a KL coefficient is non-zero."""
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0


AdvantageEstimator = Callable[["Tensor", int, GRPOConfig], "Tensor"]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "--advantage-estimator",
    builtins={
        "grpo": Builtin(target="slime.grpo.advantages:grpo"),
        "dr_grpo": Builtin(target="slime.grpo.advantages:dr_grpo"),
    },
)
"""Every entry maps ``(rewards [N], group_size, cfg) -> float32 advantages [N]``.  An entry that compares
the responses of one prompt carries ``group_relative = True`` (:func:`group_relative`)."""


def group_relative(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Mark ``estimator`` as group-relative: each advantage compares a response with the others of its
    prompt, so groups of one response give 0 (the parse-time check warns about
    ``--n-samples-per-prompt 1``).  Sets ``estimator.group_relative = True`` and returns it; a user's
    ``package.module:function`` estimator may set the same attribute."""
    estimator.group_relative = True  # type: ignore[attr-defined]
    return estimator


def is_group_relative(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` was marked with :func:`group_relative`."""
    return getattr(estimator, "group_relative", False) is True

"""GRPO math shared by every training backend.

(Module docstring to be completed with the papers followed: GRPO, DeepSeekMath, Shao et al. 2024;
Dr.GRPO, Liu et al. 2025; DAPO clip-higher, Yu et al. 2025; KL estimators, Schulman 2020.)
"""

from __future__ import annotations

import dataclasses

from slime.utils.config import ConfigError, flag


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
        "low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"], help="KL estimator for the KL loss (Schulman 2020)."
    )
    kl_coef: float = flag(0.0, help="KL penalty folded into the per-token advantage (reward shaping, k1 estimator).")
    entropy_coef: float = flag(0.0, help="Weight of the entropy bonus (subtracted from the loss).")
    eps_clip: float = flag(0.2, help="Lower PPO clip range: ratio >= 1 - eps_clip.")
    eps_clip_high: float | None = flag(None, help="Upper PPO clip range (DAPO clip-higher); default: --eps-clip.")
    calculate_per_token_loss: bool = flag(
        False, help="Average the loss over all tokens of the batch instead of per sample first (the default)."
    )

    def __post_init__(self):
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        for name in ("eps_clip", "eps_clip_high"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("kl_loss_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")

    @property
    def needs_ref_model(self) -> bool:
        """A reference model exists only when a KL coefficient is non-zero."""
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0

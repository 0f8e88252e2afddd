"""GRPO flags (GRPO_ARGS), the advantage-estimator and IS-weighting registries, importable without torch.

The built-in estimators (:mod:`slime.grpo.advantages`) and weighting functions (:mod:`slime.grpo.correction`)
are declared by import path, so checking ``--advantage-estimator`` and ``--tis-mode`` at parse time imports
none of them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from slime.utils.config import ConfigError, flag, flag_name
from slime.utils.registry import Builtin, Registry

if TYPE_CHECKING:
    from torch import Tensor

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
"""The KL estimators of ``--kl-loss-type`` (:func:`slime.grpo.loss.compute_approx_kl`)."""
TIS_LEVELS = ("token", "sequence", "geometric")
"""The levels of ``--tis-level`` (:func:`slime.grpo.correction.level_log_ratio`)."""
TIS_MODES = ("truncate", "icepop", "reject")
"""The built-in weighting functions of ``--tis-mode`` (:mod:`slime.grpo.correction`)."""


@dataclasses.dataclass
class GRPOConfig:
    """GRPO (GRPO_ARGS): advantages, clipped policy loss, KL and entropy terms."""

    advantage_estimator: str = flag(
        "grpo", metavar="NAME",
        help="Advantage estimator: grpo (group-normalised rewards, DeepSeekMath), dr_grpo (group-centred, never divided "
        "by the std), gspo (GRPO's advantages with GSPO's per-sample sequence ratio in the policy loss; give it "
        "--eps-clip 3e-4 --eps-clip-high 4e-4), or a 'package.module:function' taking (rewards, group_size, cfg).",
    )
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

    use_tis: bool = flag(
        False,
        help="Multiply each token's policy loss by an importance-sampling weight of the trainer's old log-probs "
        "against the rollout engine's, for the engine/trainer mismatch (truncated IS, Yao et al. 2025; upstream "
        "slime's flag). Needs rollout log-probs on every sample; not with --use-rollout-logprobs.",
    )
    tis_clip: float = flag(
        2.0, help="Upper bound of the IS ratio (--use-tis): truncate clamps to it, icepop / reject drop what is above."
    )
    tis_clip_low: float = flag(
        0.0, help="Lower bound of the IS ratio (--use-tis), < --tis-clip: truncate clamps to it, icepop / reject "
        "drop what is below."
    )
    tis_mode: str = flag(
        "truncate",
        choices=list(TIS_MODES),
        help="IS weighting function (--use-tis): truncate (clamp the ratio to [--tis-clip-low, --tis-clip]), icepop "
        "(the ratio inside the bounds, 0 outside: IcePop / masked IS), reject (1 inside, 0 outside: rejection "
        "sampling, no reweighting). Upstream slime names these in its mis.py example.",
    )
    tis_level: str = flag(
        "token",
        choices=list(TIS_LEVELS),
        help="What the IS ratio compares (--use-tis): each token (token), each sample's product of token ratios "
        "(sequence), or their geometric mean (geometric; use bounds close to 1, e.g. 0.999 and 1.001). A sequence "
        "or geometric weight applies to all of its sample's tokens.",
    )
    custom_tis_function_path: str | None = flag(
        None, metavar="MODULE:FUNCTION",
        help="Your own IS weighting function instead of --tis-mode (--use-tis), as package.module:function (or "
        "upstream's package.module.function): (ratio: Tensor, cfg: GRPOConfig) -> weights >= 0 of the same shape, "
        "elementwise on the --tis-level ratios. Upstream's flag, but not upstream's signature.",
    )
    use_opsm: bool = flag(
        False,
        help="Off-policy sequence masking (DeepSeek-V3.2; upstream slime's flag): drop from the policy loss every "
        "sample with a negative advantage whose KL(rollout || current policy), the mean over its tokens of "
        "log p_rollout - log p, exceeds --opsm-delta. Needs rollout log-probs on every sample.",
    )
    opsm_delta: float = flag(1e-4, help="KL threshold of --use-opsm (nats per token, >= 0).")

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
        self._check_off_policy_flags()
        if self.advantage_estimator == "gspo" and self.calculate_per_token_loss:
            raise ConfigError(
                "--advantage-estimator gspo with --calculate-per-token-loss: GSPO's ratio and loss are per sample "
                "(its objective averages over samples, arXiv:2507.18071 eq. 5); a token mean would weight samples by "
                "length. Drop --calculate-per-token-loss"
            )
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"--advantage-estimator {self.advantage_estimator!r} is unknown; "
                f"choose one of {', '.join(ADVANTAGE_ESTIMATORS.names())} or a 'package.module:attr' path"
            )

    def _check_off_policy_flags(self) -> None:
        """The IS and OPSM flags; normalises upstream's ``package.module.function`` path to ``module:function``."""
        if not self.tis_clip > 0:
            raise ConfigError(f"--tis-clip must be > 0 (an upper bound on IS ratios), got {self.tis_clip}")
        if self.tis_clip_low < 0:
            raise ConfigError(f"--tis-clip-low must be >= 0 (IS ratios are >= 0), got {self.tis_clip_low}")
        if self.tis_clip_low >= self.tis_clip:
            raise ConfigError(
                f"--tis-clip-low {self.tis_clip_low} must be below --tis-clip {self.tis_clip} (the bounds of the IS ratio)"
            )
        if not self.opsm_delta >= 0:
            raise ConfigError(f"--opsm-delta must be >= 0 (a KL threshold in nats), got {self.opsm_delta}")
        fields = {f.name: f for f in dataclasses.fields(self)}
        for switch, names in (("use_tis", ("tis_clip", "tis_clip_low", "tis_mode", "tis_level",
                                           "custom_tis_function_path")), ("use_opsm", ("opsm_delta",))):
            given = [f"{flag_name(fields[n])} {getattr(self, n)}" for n in names
                     if getattr(self, n) != fields[n].default]
            if given and not getattr(self, switch):
                switch_flag = flag_name(fields[switch])
                raise ConfigError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                  f"{switch_flag}; add {switch_flag} or drop {'it' if len(given) == 1 else 'them'}")
        path = self.custom_tis_function_path
        if path is None:
            return
        if self.tis_mode != "truncate":
            raise ConfigError(
                f"--custom-tis-function-path {path} replaces --tis-mode; drop --tis-mode {self.tis_mode}"
            )
        if ":" not in path:
            module, dot, attr = path.rpartition(".")
            if not dot or not module or not attr:
                raise ConfigError(
                    f"--custom-tis-function-path {path!r} is not a path; give package.module:function"
                )
            self.custom_tis_function_path = f"{module}:{attr}"

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether the loss reads every sample's rollout log-probs (``--use-tis``, ``--use-opsm``)."""
        return self.use_tis or self.use_opsm

    @property
    def gspo(self) -> bool:
        """GSPO's sequence-level ratio in the policy loss (``--advantage-estimator gspo``)."""
        return self.advantage_estimator == "gspo"

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
        "gspo": Builtin(target="slime.grpo.advantages:gspo"),
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


TISFunction = Callable[["Tensor", GRPOConfig], "Tensor"]
TIS_FUNCTIONS: Registry[TISFunction] = Registry(
    "IS weighting function",
    "--tis-mode",
    builtins={name: Builtin(target=f"slime.grpo.correction:{name}") for name in TIS_MODES},
)
"""Every entry maps ``(ratio, cfg) -> weights``, elementwise, ``ratio`` the ``--tis-level`` IS ratios
(:func:`slime.grpo.correction.importance_weights`); ``--custom-tis-function-path`` names one by import path."""

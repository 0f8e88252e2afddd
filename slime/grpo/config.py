"""GRPO flags (GRPO_ARGS), the advantage-estimator, IS-weighting and policy-loss-reducer registries, importable
without torch.

The built-in estimators (:mod:`slime.grpo.advantages`) and weighting functions (:mod:`slime.grpo.correction`)
are declared by import path, so checking ``--advantage-estimator`` and ``--tis-mode`` at parse time imports
none of them.  Upstream slime's flags, their departures and why: ``docs/design/grpo.md``.
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
        "--eps-clip 3e-4 --eps-clip-high 4e-4), cispo (GRPO's advantages with MiniMax-M1's CISPO loss: the clipped IS "
        "ratio, detached, times A log p), reinforce_plus_plus (REINFORCE++: the raw reward, discounted by --gamma "
        "with the --kl-coef penalty folded into each token's return; needs --normalize-advantages), "
        "reinforce_plus_plus_baseline (the reward minus its group's mean; needs --normalize-advantages), or a "
        "'package.module:function' taking (rewards, group_size, cfg). Upstream's ppo is refused: its GAE needs a "
        "critic, which this project does not train.",
    )
    disable_grpo_std_normalization: bool = flag(
        False, help="Do not divide group-centred rewards by the group std (Dr.GRPO, Liu et al. 2025)."
    )
    disable_rewards_normalization: bool = flag(
        False,
        help="Train on the raw rewards: no group normalisation at all (neither mean nor std) for grpo, dr_grpo, gspo, "
        "cispo and reinforce_plus_plus_baseline (upstream slime's flag). Refused with reinforce_plus_plus, whose "
        "rewards are never normalised.",
    )
    normalize_advantages: bool = flag(
        False,
        help="Whiten the per-token advantages over every loss-masked token of the rollout step on all data-parallel "
        "ranks: (A - mean) / sqrt(unbiased var + 1e-8), after the --kl-coef shaping (upstream slime's flag, "
        "OpenRLHF's rule). Required by reinforce_plus_plus and reinforce_plus_plus_baseline, as upstream.",
    )
    gamma: float = flag(
        1.0,
        help="Discount of reinforce_plus_plus's per-token returns, in [0, 1]: a token's return is the sum of the "
        "later tokens' rewards times gamma per position (upstream slime's flag). Only reinforce_plus_plus reads it.",
    )
    use_kl_loss: bool = flag(False, help="Add a KL(policy || reference) term to the loss (needs a reference model).")
    kl_loss_coef: float = flag(0.0, help="Weight of the KL loss term; > 0 requires a reference model.")
    kl_loss_type: str = flag(
        "k1", choices=list(KL_TYPES), help="KL estimator for the KL loss (Schulman 2020), as upstream slime."
    )
    use_unbiased_kl: bool = flag(
        False,
        help="Multiply each token's KL-loss estimate by the ratio pi / pi_old (differentiable), so that the KL is "
        "estimated under the current policy rather than the one that sampled (DeepSeek-V3.2's unbiased KL; upstream "
        "slime's flag). Needs --use-kl-loss.",
    )
    kl_coef: float = flag(0.0, help="KL penalty folded into the per-token advantage (reward shaping, k1 estimator).")
    entropy_coef: float = flag(0.0, help="Weight of the entropy bonus (subtracted from the loss); >= 0.")
    eps_clip: float = flag(0.2, help="Lower PPO clip range: ratio >= 1 - eps_clip; in [0, 1] (1: no lower bound, "
                           "CISPO's choice).")
    eps_clip_high: float | None = flag(None, help="Upper PPO clip range (DAPO clip-higher); default: --eps-clip.")
    eps_clip_c: float | None = flag(
        None,
        help="Dual-clip PPO (Ye et al. 2019, arXiv:1912.09729; upstream slime's flag): a token with a negative "
        "advantage loses at most -A * eps_clip_c, however large its ratio. > 1; unset = off. Not with cispo.",
    )
    custom_pg_loss_reducer_function_path: str | None = flag(
        None, metavar="MODULE:FUNCTION",
        help="Your own reduction of the per-token policy loss (only it; the other loss terms and metrics keep the "
        "default), as package.module:function (or upstream's package.module.function): (token_losses: list[Tensor], "
        "cfg: GRPOConfig) -> 0-d Tensor, token_losses holding each sample's loss at its loss-masked tokens that IS "
        "did not reject; the result is divided by the step's samples (tokens with --calculate-per-token-loss). "
        "Upstream's flag, not upstream's signature.",
    )
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
        "token with a negative advantage (with GRPO the whole sample) in a sample whose KL(rollout || current "
        "policy), the mean over its tokens of log p_rollout - log p, exceeds --opsm-delta. Needs rollout log-probs "
        "on every sample.",
    )
    opsm_delta: float = flag(1e-4, help="KL threshold of --use-opsm (nats per token, >= 0).")
    get_mismatch_metrics: bool = flag(
        False,
        help="Log the train/rollout mismatch metrics of upstream's mis.py under its names, averaged like the loss: "
        "train/mis_{kl,k3_kl} (KL(rollout || trainer), k1 and k3), train/mis_chi2_{token,seq} (chi-squared "
        "divergence of the token and sequence ratios), train/mis_{training,rollout}_{ppl,log_ppl} and "
        "train/mis_{log_ppl_diff,log_ppl_abs_diff,ppl_ratio} (perplexities), from the trainer's old log-probs "
        "and the engine's. Needs rollout log-probs on every sample; not with --use-rollout-logprobs.",
    )

    def __post_init__(self):
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        for name in ("eps_clip", "eps_clip_high", "kl_loss_coef", "kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.eps_clip > 1:
            raise ConfigError(
                f"--eps-clip must be in [0, 1] (the ratio's lower clip bound is 1 - eps_clip, and a ratio is never "
                f"negative), got {self.eps_clip}; e.g. 0.2, or 1 for no lower bound (CISPO). The upper range is "
                "--eps-clip-high"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ConfigError(f"--kl-loss-type {self.kl_loss_type!r} is unknown; choose one of {', '.join(KL_TYPES)}")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise ConfigError(
                f"--kl-loss-coef {self.kl_loss_coef} has no effect without --use-kl-loss; "
                "add --use-kl-loss or set --kl-loss-coef 0"
            )
        if self.use_unbiased_kl and not self.use_kl_loss:
            raise ConfigError("--use-unbiased-kl reweights the KL loss, which is off; add --use-kl-loss or drop it")
        coef = self.stop_properly_penalty_coef
        if coef is not None and not 0 <= coef <= 1:
            raise ConfigError(
                f"--stop-properly-penalty-coef must be in [0, 1] (a factor on truncated samples' rewards), got {coef}; "
                "use 0 to zero them, or leave it unset to keep their rewards"
            )
        self._check_estimator()
        self._check_off_policy_flags()
        self.custom_pg_loss_reducer_function_path = _import_path(
            "--custom-pg-loss-reducer-function-path", self.custom_pg_loss_reducer_function_path)

    def _check_estimator(self) -> None:
        """``--advantage-estimator`` and the flags that only some estimators read (upstream's asserts, and a flag that
        would do nothing refused)."""
        name = self.advantage_estimator
        if name == "ppo":
            raise ConfigError(
                "--advantage-estimator ppo: upstream's PPO takes GAE advantages from a critic (a value model trained "
                "beside the policy, upstream's --num-critic-only-steps / value loss), which this project does not "
                "train; GAE without values would be a plain discounted return, not PPO. Use grpo, "
                "reinforce_plus_plus or reinforce_plus_plus_baseline (with --normalize-advantages)"
            )
        if name not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"--advantage-estimator {name!r} is unknown; "
                f"choose one of {', '.join(ADVANTAGE_ESTIMATORS.names())} or a 'package.module:attr' path"
            )
        if name == "gspo" and self.calculate_per_token_loss:
            raise ConfigError(
                "--advantage-estimator gspo with --calculate-per-token-loss: GSPO's ratio and loss are per sample "
                "(its objective averages over samples, arXiv:2507.18071 eq. 5); a token mean would weight samples by "
                "length. Drop --calculate-per-token-loss"
            )
        if name in REINFORCE_PLUS_PLUS and not self.normalize_advantages:
            raise ConfigError(
                f"--advantage-estimator {name} needs --normalize-advantages (REINFORCE++ whitens its advantages over "
                "the batch, arXiv:2501.03262; upstream asserts the same); add it"
            )
        if self.eps_clip_c is not None and not self.eps_clip_c > 1:
            raise ConfigError(f"--eps-clip-c must be > 1 (the dual-clip bound on -A * ratio), got {self.eps_clip_c}; "
                              "e.g. 3, or leave it unset")
        if self.eps_clip_c is not None and name == "cispo":
            raise ConfigError(f"--eps-clip-c {self.eps_clip_c} bounds PPO's clipped loss, which cispo does not use "
                              "(its ratio is clipped and detached); drop --eps-clip-c")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"--gamma must be in [0, 1] (a discount per token), got {self.gamma}")
        if self.gamma != 1 and name != "reinforce_plus_plus":
            raise ConfigError(f"--gamma {self.gamma} discounts reinforce_plus_plus's returns only; use "
                              f"--advantage-estimator reinforce_plus_plus or drop --gamma (estimator: {name})")
        if self.disable_rewards_normalization and name == "reinforce_plus_plus":
            raise ConfigError("--disable-rewards-normalization with --advantage-estimator reinforce_plus_plus, whose "
                              "rewards are never normalised; drop the flag")
        if self.disable_grpo_std_normalization and (self.disable_rewards_normalization or name in NO_STD_DIVISION):
            why = ("--disable-rewards-normalization turns off the whole group normalisation" if
                   self.disable_rewards_normalization else f"--advantage-estimator {name} never divides by the std")
            raise ConfigError(f"--disable-grpo-std-normalization has no effect: {why}; drop it")

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
        if path is not None and self.tis_mode != "truncate":
            raise ConfigError(
                f"--custom-tis-function-path {path} replaces --tis-mode; drop --tis-mode {self.tis_mode}"
            )
        self.custom_tis_function_path = _import_path("--custom-tis-function-path", path)

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether the loss reads every sample's rollout log-probs (``--use-tis``, ``--use-opsm``,
        ``--get-mismatch-metrics``)."""
        return self.use_tis or self.use_opsm or self.get_mismatch_metrics

    @property
    def gspo(self) -> bool:
        """GSPO's sequence-level ratio in the policy loss (``--advantage-estimator gspo``)."""
        return self.advantage_estimator == "gspo"

    @property
    def cispo(self) -> bool:
        """CISPO's policy loss (``--advantage-estimator cispo``)."""
        return self.advantage_estimator == "cispo"

    @property
    def reinforce_plus_plus_returns(self) -> bool:
        """REINFORCE++'s discounted per-token returns (``--advantage-estimator reinforce_plus_plus``)."""
        return self.advantage_estimator == "reinforce_plus_plus"

    @property
    def needs_ref_model(self) -> bool:
        """A reference model exists only when a KL coefficient is non-zero."""
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0


def _import_path(flag: str, path: str | None) -> str | None:
    """``path`` of a function flag as ``package.module:function`` (upstream's ``package.module.function`` converted).

    Raises:
        ConfigError: neither form.
    """
    if path is None or ":" in path:
        return path
    module, dot, attr = path.rpartition(".")
    if not dot or not module or not attr:
        raise ConfigError(f"{flag} {path!r} is not a path; give package.module:function")
    return f"{module}:{attr}"


REINFORCE_PLUS_PLUS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The estimators that upstream (and REINFORCE++) only runs with ``--normalize-advantages``."""
NO_STD_DIVISION = ("dr_grpo", *REINFORCE_PLUS_PLUS)
"""Built-in estimators that never divide by the group std (``--disable-grpo-std-normalization`` does nothing)."""
MISMATCH_METRICS = ("mis_kl", "mis_k3_kl", "mis_chi2_token", "mis_chi2_seq", "mis_training_log_ppl",
                    "mis_training_ppl", "mis_rollout_log_ppl", "mis_rollout_ppl", "mis_log_ppl_diff",
                    "mis_log_ppl_abs_diff", "mis_ppl_ratio")
"""The ``train/*`` metrics of ``--get-mismatch-metrics`` (:func:`slime.grpo.correction.mismatch_metrics`)."""


AdvantageEstimator = Callable[["Tensor", int, GRPOConfig], "Tensor"]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "--advantage-estimator",
    builtins={
        "grpo": Builtin(target="slime.grpo.advantages:grpo"),
        "dr_grpo": Builtin(target="slime.grpo.advantages:dr_grpo"),
        "gspo": Builtin(target="slime.grpo.advantages:gspo"),
        "cispo": Builtin(target="slime.grpo.advantages:cispo"),
        "reinforce_plus_plus": Builtin(target="slime.grpo.advantages:reinforce_plus_plus"),
        "reinforce_plus_plus_baseline": Builtin(target="slime.grpo.advantages:reinforce_plus_plus_baseline"),
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


PGLossReducer = Callable[["list[Tensor]", GRPOConfig], "Tensor"]
PG_LOSS_REDUCERS: Registry[PGLossReducer] = Registry("policy-loss reducer", "--custom-pg-loss-reducer-function-path")
"""Every entry maps ``(token_losses, cfg) -> 0-d Tensor``: ``token_losses[s]`` the per-token policy loss of sample
``s`` at its loss-masked tokens that IS did not reject (``[n_s]``, in order); the result is this micro-batch's sum that
the step's normaliser divides (the default: each sample's mean, summed; with ``--calculate-per-token-loss`` every
token, summed).  No built-in: ``--custom-pg-loss-reducer-function-path`` names one by import path."""

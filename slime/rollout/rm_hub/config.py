"""Reward flags (part of ROLLOUT_ARGS), the reward-function registry and its one signature.

Importable without math-verify or SymPy: the built-in reward functions are declared by import
path and imported on their first lookup (:func:`resolve_reward_function`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Protocol

from slime.utils.config import ConfigError, flag
from slime.utils.registry import Builtin, Registry, check_function, not_found_itself, search_path_hint

logger = logging.getLogger(__name__)

TOLERANCE_READERS = ("geo3k",)
"""The built-in reward functions that read ``--rm-tolerance`` (a custom one may too: not checked)."""


class RewardFunction(Protocol):
    """The one signature of reward functions: ``(response, label, cfg: RewardConfig) -> float``.

    Raising marks the response as an error (0.0, counted).  It runs under the scorer's ``SIGALRM`` timer,
    so it must not arm ``SIGALRM`` itself (math-verify with its default timeouts does).
    """

    def __call__(self, response: str, label: str, cfg: RewardConfig) -> float: ...


REWARD_FUNCTIONS: Registry[RewardFunction] = Registry(
    "reward function",
    "--rm-type",
    builtins={
        "math": Builtin(target="slime.rollout.rm_hub.math_reward:math_reward"),
        "deepscaler": Builtin(target="slime.rollout.rm_hub.deepscaler:deepscaler_reward"),
        "geo3k": Builtin(target="slime.rollout.rm_hub.geo3k:geo3k_reward"),
    },
)
"""Name -> reward function, built-ins declared by import path (checking ``--rm-type`` imports none of
them).  ``name in REWARD_FUNCTIONS`` also accepts ``module:function`` paths."""


@dataclasses.dataclass
class RewardConfig:
    """Reward (part of ROLLOUT_ARGS): which reward function scores a response against its label."""

    rm_type: str = flag(
        "math",
        help="Reward function: math (default), deepscaler, geo3k, or a 'package.module:function' "
        "with the signature (response: str, label: str, cfg: RewardConfig) -> float.",
    )
    custom_rm_path: str | None = flag(
        None,
        help="'package.module:function' with the signature (response: str, label: str, cfg: RewardConfig) "
        "-> float; overrides --rm-type.",
    )
    rm_tolerance: float = flag(
        0.05,
        help="Relative tolerance of the geo3k reward, |pred - gold| <= tol * |gold|, applied only when the "
        "answer and the label are written at different decimal precision and one rounds to the other at the "
        "label's precision (answer vs label: 13.86 vs 8\\sqrt{3} and 129.904 vs 129.9 score 1; 14.1, 14.10 or 15 "
        "vs 14.6 and 94.0 vs 96 score 0) (dimensionless; 0 = strict, the same as the math reward).",
    )
    rm_timeout: float = flag(
        5.0,
        help="Time limit of one reward call, seconds (a timed-out response scores 0 and is counted). "
        "A worker stuck past 2 * timeout + 1 s is killed and restarted.",
    )
    rm_num_workers: int = flag(2, help="Worker processes that score responses in parallel.")

    def __post_init__(self):
        if self.rm_type not in REWARD_FUNCTIONS:
            raise ConfigError(
                f"--rm-type {self.rm_type!r} is not a reward function; use one of "
                f"{', '.join(REWARD_FUNCTIONS.names())} or a 'package.module:function' path"
            )
        if self.custom_rm_path is not None:
            module, _, function = self.custom_rm_path.partition(":")
            if not module or not function:
                raise ConfigError(
                    f"--custom-rm-path {self.custom_rm_path!r} is not a 'package.module:function' path; "
                    f"write it as e.g. 'my_rewards.geometry:score'"
                )
        if not 0 <= self.rm_tolerance < 1:
            raise ConfigError(
                f"--rm-tolerance must be a relative tolerance in [0, 1), got {self.rm_tolerance}; "
                f"use e.g. 0.05 (5 %), or 0 for strict matching"
            )
        builtin = self.custom_rm_path is None and self.rm_type in REWARD_FUNCTIONS.builtins
        if builtin and self.rm_type not in TOLERANCE_READERS and self.rm_tolerance != RewardConfig.rm_tolerance:
            logger.warning("--rm-tolerance %g has no effect with --rm-type %s, which does not read it (only %s "
                           "does); drop it, or use --rm-type geo3k", self.rm_tolerance, self.rm_type,
                           ", ".join(TOLERANCE_READERS))
        if not (self.rm_timeout > 0 and math.isfinite(self.rm_timeout)):
            raise ConfigError(f"--rm-timeout must be a finite number of seconds > 0, got {self.rm_timeout}; use e.g. 5")
        if self.rm_num_workers < 1:
            raise ConfigError(f"--rm-num-workers must be >= 1, got {self.rm_num_workers}")


def resolve_reward_function(cfg: RewardConfig) -> RewardFunction:
    """The reward function ``cfg`` selects (``--custom-rm-path`` if given, else ``--rm-type``), imported here.

    Raises:
        ConfigError: the path cannot be imported (its module raised anything while importing), is not callable, or
            does not accept ``(response, label, cfg)``; the message names the flag.
    """
    flag_name, name = ("--custom-rm-path", cfg.custom_rm_path) if cfg.custom_rm_path else ("--rm-type", cfg.rm_type)
    try:
        function = REWARD_FUNCTIONS.get(name)
    except (ImportError, AttributeError) as error:
        module = name.partition(":")[0]
        hint = (search_path_hint(module) if not_found_itself(module, error)
                else "check the module path and the function name")
        raise ConfigError(f"{flag_name} {name!r} cannot be imported ({error}); {hint}") from None
    except Exception as error:  # importing a user's module runs its code: a SyntaxError, or anything it raises
        raise ConfigError(f"{flag_name} {name!r} cannot be imported: importing it raised {type(error).__name__}: "
                          f"{error}; fix the module") from None
    check_function(function, flag_name, name, ("response", "label", cfg), "a reward function must accept "
                   "(response: str, label: str, cfg: RewardConfig) and return a float")
    return function

"""Reward functions ("reward models"), registered by name and selected with ``--rm-type``.

(To be completed: registry, batched scoring in a process pool, ``math`` / ``deepscaler`` / ``geo3k``.)
"""

from __future__ import annotations

import dataclasses

from slime.utils.config import ConfigError, flag


@dataclasses.dataclass
class RewardConfig:
    """Reward (part of ROLLOUT_ARGS): which reward function scores a response against its label."""

    rm_type: str = flag("math", help="Reward function: math (default), deepscaler, geo3k, or 'module:function'.")
    custom_rm_path: str | None = flag(
        None, help="'package.module:function' scoring (response, label, metadata) -> float; overrides --rm-type."
    )
    rm_tolerance: float = flag(
        0.05, help="Relative tolerance of the geo3k reward for labels that are rounded decimals (0 = strict)."
    )
    rm_timeout: float = flag(5.0, help="math-verify timeout per response, seconds.")
    rm_num_workers: int = flag(2, help="Processes that score responses in parallel.")

    def __post_init__(self):
        if self.rm_tolerance < 0:
            raise ConfigError(f"--rm-tolerance must be >= 0, got {self.rm_tolerance}")
        if self.rm_timeout <= 0:
            raise ConfigError(f"--rm-timeout must be > 0 seconds, got {self.rm_timeout}")
        if self.rm_num_workers < 1:
            raise ConfigError(f"--rm-num-workers must be >= 1, got {self.rm_num_workers}")

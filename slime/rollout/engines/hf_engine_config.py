"""Parse-time checks of ``--rollout-backend transformers``
(:class:`slime.rollout.engines.hf_engine.TransformersEngine`), importable without the engine's module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime.rollout.engines.config import EngineConfig
from slime.utils.config import ConfigError

if TYPE_CHECKING:
    from slime.rollout.config import RolloutConfig
    from slime.rollout.engines.sglang.flags import SGLangConfig


class TransformersEngineConfig(EngineConfig):
    """The transformers engine runs no SGLang server, so ``--sglang-*`` flags would be ignored: refused."""

    @classmethod
    def check(cls, rollout: RolloutConfig, sglang: SGLangConfig, hf_checkpoint: str | None = None) -> None:
        """Raises:
        ConfigError: any ``--sglang-*`` flag is given; the message names them all.
        """
        if sglang.server_args:
            names = [arg for arg in sglang.to_argv() if arg.startswith("--")]
            raise ConfigError(
                f"--rollout-backend {rollout.rollout_backend} does not run SGLang, so {' '.join(names)} would be "
                f"ignored; remove {'it' if len(names) == 1 else 'them'} or use --rollout-backend sglang"
            )

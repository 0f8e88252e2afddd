"""Rollout engines by ``--rollout-backend`` name (see :mod:`slime.rollout.engines.base` for the interface).

Built-in engines are declared by import path (:class:`slime.utils.registry.Builtin`), like the
training backends, and imported on their first lookup: importing this package imports no
engine module (so neither transformers' model code nor sglang).  Each built-in may name its
*config*: an :class:`slime.rollout.engines.config.EngineConfig` subclass with its parse-time
checks, importable without the engine's packages.

The SGLang engine is declared but not built yet (``target=None``): ``--rollout-backend sglang``
stops at parse time, saying whether sglang is installed.
"""

from slime.rollout.engines.base import RolloutEngine
from slime.utils.registry import Builtin, Registry

ENGINES: Registry[type[RolloutEngine]] = Registry(
    "rollout engine",
    "--rollout-backend",
    builtins={
        "transformers": Builtin(
            target="slime.rollout.engines.hf_engine:TransformersEngine",
            config="slime.rollout.engines.hf_engine_config:TransformersEngineConfig",
        ),
        "sglang": Builtin(
            target=None,
            # The `sglang` extra of pyproject.toml.
            requires=("sglang==0.5.17",),
            planned="the SGLang engine is next on the roadmap; use --rollout-backend transformers meanwhile",
        ),
    },
)
"""Engine classes (:class:`RolloutEngine` subclasses), each built inside its own Ray actor."""

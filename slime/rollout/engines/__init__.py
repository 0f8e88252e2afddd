"""Rollout engines by ``--rollout-backend`` name (interface: :mod:`slime.rollout.engines.base`).

Built-ins are declared by import path (:class:`slime.utils.registry.Builtin`) and imported on first lookup, so
importing this package imports no engine module (neither transformers' model code nor SGLang); each names its
parse-time checks (:class:`slime.rollout.engines.config.EngineConfig`).  Without the ``sglang`` distribution,
``--rollout-backend sglang`` stops at parse time, naming the way out.
"""

from slime.utils.registry import Builtin, Registry

ENGINES: Registry[type] = Registry(
    "rollout engine",
    "--rollout-backend",
    builtins={
        "transformers": Builtin(
            target="slime.rollout.engines.hf_engine:TransformersEngine",
            config="slime.rollout.engines.hf_engine_config:TransformersEngineConfig",
        ),
        "sglang": Builtin(
            target="slime.rollout.engines.sglang.engine:SGLangEngine",
            # The `sglang` extra of pyproject.toml.
            requires=("sglang==0.5.17",),
            config="slime.rollout.engines.sglang.config:SGLangEngineConfig",
            fix="SGLang serves on GPUs and is installed by the GPU profile (bash scripts/setup_env.sh on a GPU "
            "node, or SLIME_WHEELHOUSE=DIR air-gapped); here use --rollout-backend transformers",
        ),
    },
)
"""Engine classes (:class:`slime.rollout.engines.base.RolloutEngine` subclasses), each built inside its own Ray
actor.  The registry names the engines' base class only here: it imports no engine module, not even for typing,
since the engines take the whole run config (:class:`slime.arguments.SlimeConfig`), which imports this registry."""

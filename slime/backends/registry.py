"""``--train-backend`` name -> training-backend class.

Every entry is a :class:`slime.backends.base.TrainerBackend` subclass with the same
constructor entry point, ``from_config(cfg: SlimeConfig, rank_info: RankInfo)``, which the
trainer group calls in each rank's process (``functools.partial(cls.from_config, cfg)``).
A ``package.module:Class`` name is imported on lookup, so users plug in their own backend.

Built-in backends are declared by import path (:class:`slime.utils.registry.Builtin`) and
imported on first lookup: importing this module imports no backend, in particular not
Megatron (``megatron-core`` exists on GPU machines only).  Each built-in also names its
*config*: the :class:`slime.backends.config.BackendConfig` flag group that owns its flags, its
parse-time checks, its data-parallel size and its checkpoint layout, importable without the
backend's packages.

``--train-backend megatron`` needs megatron-core (installed in the CPU and GPU profiles); without
it the flag stops at parse time, naming the package, whether it is installed and the way out.
"""

from __future__ import annotations

from slime.utils.registry import Builtin, Registry

TRAIN_BACKENDS: Registry[type] = Registry(
    "training backend",
    "--train-backend",
    builtins={
        "fsdp": Builtin(
            target="slime.backends.fsdp.backend:FSDPBackend",
            config="slime.backends.fsdp.config:FSDPConfig",
        ),
        "megatron": Builtin(
            target="slime.backends.megatron.backend:MegatronBackend",
            # megatron-core alone runs the backend (CPU: fp32 torch kernels); the bf16 GPU kernels of the
            # rest of the `megatron` extra are checked where they are picked
            # (slime.backends.megatron.model.GPU_KERNEL_PACKAGES).
            requires=("megatron-core==0.16.1",),
            config="slime.backends.megatron.config:MegatronConfig",
            fix="install megatron-core==0.16.1 (both set-up profiles have it: bash scripts/setup_env.sh), "
            "or use --train-backend fsdp",
        ),
    },
)
"""Training backends (:class:`slime.backends.base.TrainerBackend` subclasses) by ``--train-backend`` name (built-ins
and ``register``-ed ones).  The base class is named here only: the registry imports no backend module, not even
for typing (the parser imports the registry; a backend may refer to the run config)."""

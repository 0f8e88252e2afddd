"""``--train-backend`` name -> training-backend class (each a :class:`slime.backends.step.StepBackend`).

The trainer group builds each rank with ``cls(rank_info, spec, config)`` (:class:`slime.backends.config.TrainerSpec`,
the backend's own flag group); a ``package.module:Class`` name is
imported on lookup, so users plug in their own backend.  Built-ins are declared by import path and imported on first
lookup (this module imports no backend, megatron-core least of all); each names its
:class:`slime.backends.config.BackendConfig` (flags, checks, data-parallel size, checkpoint layout).
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
"""Training backends (each a :class:`slime.backends.step.StepBackend`) by ``--train-backend`` name (built-ins and
``register``-ed ones).  The protocol is named here only: the registry imports no backend module, not even for typing
(the parser imports the registry)."""

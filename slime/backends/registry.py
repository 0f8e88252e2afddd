"""``--train-backend`` name -> training-backend class.

Every entry is a :class:`slime.backends.base.TrainerBackend` subclass with the same
constructor entry point, ``from_config(cfg: SlimeConfig, rank_info: RankInfo)``, which the
trainer group calls in each rank's process (``functools.partial(cls.from_config, cfg)``).
A ``package.module:Class`` name is imported on lookup, so users plug in their own backend.

Built-in backends are named by import path and imported on first lookup: importing this
module imports no backend, in particular not Megatron (``megatron-core`` exists on GPU
machines only).  The Megatron backend adds one line to :data:`BUILTIN_BACKENDS`.
"""

from __future__ import annotations

from slime.backends.base import TrainerBackend
from slime.utils.registry import Registry, import_object

BUILTIN_BACKENDS = {
    "fsdp": "slime.backends.fsdp.backend:FSDPBackend",
}
"""Built-in ``--train-backend`` names and the ``module:Class`` each one imports."""


class _LazyRegistry(Registry[type[TrainerBackend]]):
    """A :class:`Registry` that also knows :data:`BUILTIN_BACKENDS` and imports one on its first lookup."""

    def names(self) -> list[str]:
        return sorted(set(super().names()) | set(BUILTIN_BACKENDS))

    def __contains__(self, name: str) -> bool:
        return name in BUILTIN_BACKENDS or super().__contains__(name)

    def get(self, name: str) -> type[TrainerBackend]:
        """The backend class registered as ``name``, or at the import path ``name``.

        Raises:
            KeyError: unknown name; the message lists the valid ones.
            ImportError: the backend's module cannot be imported (e.g. megatron-core missing).
        """
        if name in BUILTIN_BACKENDS and name not in super().names():
            self.register(name)(import_object(BUILTIN_BACKENDS[name]))
        return super().get(name)


TRAIN_BACKENDS = _LazyRegistry("training backend", "--train-backend")
"""Training backends by ``--train-backend`` name (built-ins and ``register``-ed ones)."""

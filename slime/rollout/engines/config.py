"""The light side of a rollout engine: its parse-time checks, importable without the engine's packages.

A built-in engine names its config in :data:`slime.rollout.engines.ENGINES`
(:attr:`slime.utils.registry.Builtin.config`); :func:`slime.arguments.validate` runs the
selected engine's :meth:`EngineConfig.check` at parse time.  Engines given as a
``package.module:Class`` import path get this base class, which checks nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from slime.rollout.config import RolloutConfig, SGLangConfig


class EngineConfig:
    """Parse-time checks of one engine kind (class methods; never instantiated)."""

    parity_check: ClassVar[bool] = False
    """The engine class's :attr:`slime.rollout.engines.base.RolloutEngine.parity_check`, known at parse time
    (the parity check's own flags are checked only for engines it runs with)."""

    @classmethod
    def check(cls, rollout: RolloutConfig, sglang: SGLangConfig, hf_checkpoint: str | None = None) -> None:
        """Refuse flag values this engine cannot honour (instead of silently ignoring them); ``hf_checkpoint`` is
        ``--hf-checkpoint`` (a local folder, a hub name, or None), for checks against the checkpoint.

        Raises:
            ConfigError: naming the flags, their values and the fix.
        """


def rollout_routes_wanted(cfg, *, parity_check: bool) -> bool:
    """Whether a run's engines capture routed experts and its training rollouts ask for them: an MoE
    ``--hf-checkpoint`` with ``--use-rollout-routing-replay`` (the trainer replays them), or with the engine parity
    check replaying them (``parity_check``: the engine kind runs it; then the engine captures every forward's routes
    anyway, and the trainer's router agreement is measured at no extra cost).  ``cfg``: the run's SlimeConfig."""
    from slime.data.routes import RouteShape

    parity = cfg.parity
    replayed_by_parity = parity_check and parity.engine_parity_replay_routes and not parity.skip_engine_parity_check
    wanted = cfg.train.use_rollout_routing_replay or replayed_by_parity
    return wanted and RouteShape.from_checkpoint(cfg.checkpoint.hf_checkpoint) is not None

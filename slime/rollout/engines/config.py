"""The light side of a rollout engine: what every engine is handed (:class:`EngineSpec`) and its parse-time checks,
importable without the engine's packages.

A built-in engine names its config in :data:`slime.rollout.engines.ENGINES`
(:attr:`slime.utils.registry.Builtin.config`); :func:`slime.arguments.validate` runs the
selected engine's :meth:`EngineConfig.check` at parse time.  Engines given as a
``package.module:Class`` import path get this base class, which checks nothing.  An engine is built from an
:class:`EngineSpec` and its resources (``engine_cls.from_spec(spec, resources)``), never from the whole config.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from slime.rollout.config import RolloutConfig
    from slime.rollout.engines.sglang.flags import SGLangConfig


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


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What every rollout engine of a run is handed.

    Attributes:
        hf_checkpoint: ``--hf-checkpoint``, the weights an engine starts from.
        rollout_seed: ``--rollout-seed``; engine ``i`` seeds requests that bring no seed with ``rollout_seed + i``.
        image_min_pixels, image_max_pixels: the data pipeline's pixel bounds (``--image-min-pixels`` /
            ``--image-max-pixels``; None: the processor's), for an engine that processes images itself.
        sglang: the ``--sglang-*`` pass-through (:class:`~slime.rollout.engines.sglang.flags.SGLangConfig`).
        output_dir: the run's folder (``--output-dir``), where an engine keeps its logs; None: a temporary one.
        return_routed_experts: the engines capture routed experts
            (:func:`slime.routing_replay.rollout_routes_wanted` for this engine kind).
    """

    hf_checkpoint: str
    rollout_seed: int = 0
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    sglang: SGLangConfig | None = None
    output_dir: str | None = None
    return_routed_experts: bool = False

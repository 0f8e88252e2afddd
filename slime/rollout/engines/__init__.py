"""Rollout engines by ``--rollout-backend`` name (see :mod:`slime.rollout.engines.base` for the interface).

Engine modules import their heavy dependencies (transformers, SGLang) only when an engine is
built, so importing this package is cheap and never imports sglang.
"""

from slime.rollout.engines.base import RolloutEngine
from slime.rollout.engines.hf_engine import TransformersEngine
from slime.utils.registry import Registry

ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine", "--rollout-backend")
"""Engine classes (:class:`RolloutEngine` subclasses), each built inside its own Ray actor."""

ENGINES.register("transformers")(TransformersEngine)

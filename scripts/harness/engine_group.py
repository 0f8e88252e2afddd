"""The engine group of a run, built as the driver builds it, for the tests and the benchmarks (not a test module).

:func:`build_engines` makes ``cfg``'s ``--rollout-backend`` engines (the class through the registry, CPU placement
groups); :func:`start_engines` waits until they are healthy.  Needs Ray started (:func:`slime.ray.placement.init_ray`).
"""

from __future__ import annotations


def build_engines(cfg):
    """``(placement, engines)`` for ``cfg``'s ``--rollout-backend``, built as the driver builds them (the engine class
    through the registry, CPU placement groups); the actors are starting and nobody has polled their health yet.
    The caller shuts the engines down and removes the placement (done here when the group cannot be built)."""
    import functools

    from slime.driver import resolve_components
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.ray.placement import create_placement_groups

    engine_cls = resolve_components(cfg).engine_cls
    placement = create_placement_groups(cfg.cluster, use_gpu=False)
    try:
        engines = RolloutEngineGroup(placement, functools.partial(engine_cls.from_spec,
                                                                      cfg.engine_spec(engine_cls.parity_check)),
                                     engine_cls.max_concurrent_calls)
    except BaseException:
        placement.remove()
        raise
    return placement, engines


def start_engines(cfg, timeout_s: float):
    """:func:`build_engines`, healthy (``wait_until_healthy(timeout_s)``); the caller removes the placement.  If
    the engines do not start, the placement is removed and the error raised."""
    placement, engines = build_engines(cfg)
    try:
        engines.wait_until_healthy(timeout_s)
    except BaseException:
        placement.remove()
        raise
    return placement, engines

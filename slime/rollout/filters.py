"""Dynamic-sampling group filters, ``fn(group: list[Sample]) -> GroupVerdict | bool``, registered in :data:`FILTERS`.

Built-ins: ``nonzero_std`` (DAPO: keep a group whose rewards vary) and ``nonzero_std_with_fallback`` (the same,
but its rejected groups may fill the batch once ``--dynamic-sampling-max-rounds`` is spent).  Upstream slime's
dotted paths resolve to them (:data:`UPSTREAM_PATHS`).  Light: importable by the flag modules.  How the rollout
manager uses them: :mod:`slime.rollout.dynamic_sampling`, ``docs/design/dynamic_sampling.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from typing import TYPE_CHECKING, Callable

from slime.utils.config import ConfigError
from slime.utils.registry import Builtin, Registry, check_function

if TYPE_CHECKING:
    from slime.data.sample import Sample

logger = logging.getLogger(__name__)

DROP_PREFIX = "rollout/dynamic_filter/drop_"
"""The metric of the groups a filter dropped, per reason (upstream's ``MetricGatherer`` name)."""
NON_FINITE = "non_finite_reward"
"""The reason of a group holding a NaN or infinite reward, dropped before any filter sees it."""
NON_FINITE_METRIC = "rollout/non_finite_reward_groups"
"""The metric of the groups dropped for a NaN or infinite reward, with or without dynamic sampling (every step)."""
NON_FINITE_WARNING = ("dropping the group of dataset index %s: its rewards %s are not all finite (a fault of the reward "
                      "function; counted in %s)")
"""The warning on such a group (its dataset index, rewards, :data:`NON_FINITE_METRIC`), with or without a filter."""
STD_EPS = 1e-6
"""A group whose reward std (unbiased, float64) is at most this is constant (upstream's threshold)."""


@dataclasses.dataclass(frozen=True)
class GroupVerdict:
    """A filter's verdict on one group of ``--n-samples-per-prompt`` scored samples.

    Attributes:
        keep: the group may train.
        reason: why it is rejected; names the metric ``rollout/dynamic_filter/drop_<reason>`` (upstream's; letters,
            digits, ``_`` ``.`` ``-``); None: ``filtered``.
        fallback: a rejected group that may fill the batch when the rounds run out (else the step stops).
        score: rank of a rejected group for that fill, higher first (ties: draw order).
    """

    keep: bool
    reason: str | None = None
    fallback: bool = False
    score: float = 0.0


GroupFilter = Callable[["list[Sample]"], "GroupVerdict | bool"]


def nonzero_std(group: list[Sample]) -> GroupVerdict:
    """Keep the group when the unbiased std of its rewards (float64) exceeds :data:`STD_EPS`; the reason of a
    rejected group is ``zero_std_<reward>``, its first reward rounded to 0.1 as Python writes it (``zero_std_1.0``,
    ``zero_std_0.0``: upstream's ``check_reward_nonzero_std``).  Its score is the std (0 for a rejected group).  A
    group with a NaN or infinite reward is rejected (:func:`non_finite_verdict`)."""
    rewards = [float(s.reward) for s in group]
    if not all(math.isfinite(r) for r in rewards):
        return non_finite_verdict(group)
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    if std > STD_EPS:
        return GroupVerdict(True, score=std)
    return GroupVerdict(False, reason=f"zero_std_{round(rewards[0], 1)}", score=std)


def non_finite_verdict(group: list[Sample]) -> GroupVerdict:
    """The verdict on a group holding a NaN or infinite reward: dropped (reason :data:`NON_FINITE`), never a fallback
    (its advantages would not be finite); a warning names the group's dataset index and rewards.  Upstream drops such
    a group too (its std is NaN), as ``zero_std_<first reward>``.  The rollout manager drops such a group the same
    way without dynamic sampling (:func:`slime.rollout.manager._drop_non_finite_groups`)."""
    logger.warning(NON_FINITE_WARNING, group[0].index, [s.reward for s in group], NON_FINITE_METRIC)
    return GroupVerdict(False, reason=NON_FINITE)


def nonzero_std_with_fallback(group: list[Sample]) -> GroupVerdict:
    """:func:`nonzero_std`, its rejected groups marked ``fallback`` (not those with a non-finite reward)."""
    verdict = nonzero_std(group)
    return verdict if verdict.reason == NON_FINITE else dataclasses.replace(verdict, fallback=True)


FILTERS: Registry[GroupFilter] = Registry(
    "dynamic sampling filter",
    "--dynamic-sampling-filter-path",
    builtins={
        "nonzero_std": Builtin(target="slime.rollout.filters:nonzero_std"),
        "nonzero_std_with_fallback": Builtin(target="slime.rollout.filters:nonzero_std_with_fallback"),
    },
)

UPSTREAM_PATHS = {
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": "nonzero_std",
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback":
        "nonzero_std_with_fallback",
}
"""Upstream slime's filter paths -> the built-in that does the same (upstream command lines keep working)."""

UPSTREAM_PACKAGE = "slime.rollout.filter_hub."
"""Upstream's filter package, which this project does not have: a path into it is one of :data:`UPSTREAM_PATHS`."""


def filter_name(value: str) -> str:
    """``--dynamic-sampling-filter-path`` as a registry name: an upstream path becomes its built-in, a dotted
    ``package.module.function`` (upstream's form) becomes ``package.module:function``; anything else as is."""
    if value in UPSTREAM_PATHS:
        return UPSTREAM_PATHS[value]
    if value not in FILTERS.builtins and ":" not in value and "." in value:
        module, _, attr = value.rpartition(".")
        return f"{module}:{attr}"
    return value


def check_filter_path(value: str) -> str:
    """Parse-time check of ``--dynamic-sampling-filter-path`` without importing a user's module.

    Returns:
        The registry name (:func:`filter_name`).

    Raises:
        ConfigError: neither a built-in nor an import path, or a module that cannot be found.
    """
    if value.startswith(UPSTREAM_PACKAGE) and value not in UPSTREAM_PATHS:
        raise ConfigError(
            f"--dynamic-sampling-filter-path {value!r} is not one of upstream's filters that this project has: "
            f"{', '.join(UPSTREAM_PATHS)} (or the built-ins {', '.join(FILTERS.names())})"
        )
    name = filter_name(value)
    if name not in FILTERS:
        raise ConfigError(
            f"--dynamic-sampling-filter-path {value!r} is not a filter; use one of {', '.join(FILTERS.names())}, "
            "upstream's slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std[_with_fallback], "
            "or a 'package.module:function' path"
        )
    problem = FILTERS.problem(name)
    if problem is not None:
        raise ConfigError(problem)
    return name


def resolve_filter(value: str) -> GroupFilter:
    """The filter ``value`` names, imported here.

    Raises:
        ConfigError: it cannot be imported, is not callable or does not take one argument; the message names
            the flag.
    """
    name = check_filter_path(value)
    fn = FILTERS.resolve(name)
    check_function(fn, "--dynamic-sampling-filter-path", value, ([],), "a filter must accept (group: list[Sample]) "
                   "and return a GroupVerdict or a bool")
    return fn


def verdict_of(fn: GroupFilter | None, group: list[Sample]) -> GroupVerdict:
    """``fn(group)`` as a :class:`GroupVerdict` (a bool, numpy or torch 0-d bool is ``keep``: upstream's legacy form);
    a group with a NaN or infinite reward is dropped before ``fn`` sees it (:func:`non_finite_verdict`).  ``fn``
    None (over-sampling without a filter): every other group is kept.

    Raises:
        TypeError: ``fn`` returned something else; the message names the group's dataset index.
    """
    if not all(math.isfinite(float(s.reward)) for s in group):
        return non_finite_verdict(group)
    if fn is None:
        return GroupVerdict(True)
    out = fn(group)
    if isinstance(out, GroupVerdict):
        return out
    if isinstance(out, bool) or (str(getattr(out, "dtype", "")) in ("bool", "torch.bool") and out.ndim == 0):
        return GroupVerdict(bool(out))  # also a numpy or torch 0-d bool
    raise TypeError(
        f"the dynamic sampling filter {getattr(fn, '__qualname__', fn)!r} returned {out!r} for the group of dataset "
        f"index {group[0].index}; a filter returns a GroupVerdict or a bool"
    )

"""Name -> implementation registries (reward functions, advantage estimators, engines, backends).

Every entry of one registry has the same signature, so callers never need an if-chain.
A duplicate name raises; an unknown name raises with the list of valid ones.  A name of
the form ``package.module:attr`` (or ``package.module.attr``) is imported on lookup, which
is how users plug in their own implementation without editing slime.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of interchangeable implementations.

    Args:
        kind: what is registered, used in error messages (e.g. ``"reward function"``).
        flag: the command-line flag that selects an entry, used in error messages.
    """

    def __init__(self, kind: str, flag: str):
        self.kind = kind
        self.flag = flag
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers ``obj`` under ``name``.

        Raises:
            KeyError: ``name`` is already registered.
        """

        def deco(obj: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or _is_import_path(name)

    def get(self, name: str) -> T:
        """Look ``name`` up, importing it when it is a ``module:attr`` path.

        Raises:
            KeyError: unknown name; the message lists the valid ones.
            ImportError / AttributeError: an import path that does not resolve.
        """
        if name in self._entries:
            return self._entries[name]
        if _is_import_path(name):
            return import_object(name)
        raise KeyError(
            f"unknown {self.kind} {name!r} for {self.flag}; valid: {', '.join(self.names())} "
            f"(or a 'package.module:attr' import path)"
        )


def _is_import_path(name: str) -> bool:
    return ":" in name


def import_object(path: str):
    """Import ``package.module:attr`` and return ``attr``.

    Raises:
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
    """
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None

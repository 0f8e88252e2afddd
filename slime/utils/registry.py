"""Name -> implementation registries (reward functions, advantage estimators, engines, backends, transports).

Every entry of one registry has the same signature, so callers never need an if-chain.
A duplicate name raises; an unknown name raises with the list of valid ones.  A name of
the form ``package.module:attr`` is imported on lookup, which is how users plug in their own
implementation without editing slime.

Built-in implementations whose modules are heavy or need optional packages (the training
backends, the rollout engines, the weight-sync transports) are *declared* rather than
imported: a :class:`Builtin` names the ``module:attr`` to import on the first lookup, the
distributions that import needs, and the light module with its flags and checks.  Importing a
registry therefore imports none of them (never megatron-core nor sglang), and
:meth:`Registry.problem` tells at parse time, without importing the entry, whether it can run
here: a built-in that is not in this version yet, or whose packages are missing or at another
version than the pin, is named together with what is installed and what is needed.
:meth:`Registry.resolve` is :meth:`Registry.get` for start-up checks: every failure (an unknown
name, a missing package, an import path that does not import) becomes a
:class:`~slime.utils.config.ConfigError` that names the flag.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from typing import Callable, Generic, Mapping, TypeVar

from slime.utils.config import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in entry that a registry knows by name before importing it.

    Attributes:
        target: ``"package.module:attr"`` imported on the first lookup; ``None`` for an entry
            that is planned but not in this version (its lookup raises :class:`Unavailable`).
        requires: distributions the target needs beyond slime's base dependencies, in pip's
            spelling with the pinned version, e.g. ``("megatron-core==0.16.1",)`` (or a bare name:
            any version).  Checked with ``importlib.metadata``, so checking imports nothing; an
            installed version other than the pin (compared without its local label, so
            ``2.11.0+cu130`` meets ``==2.11.0``) counts as not met.
        config: ``"package.module:attr"`` of the entry's light side (its flag group and parse-time
            checks), importable without ``requires``; ``None`` when it has none.
        planned: for ``target=None``: what is missing, e.g. "the native Megatron Qwen3.5 backend
            (next on the roadmap)".
        fix: the way out when ``requires`` is not met, appended to :meth:`Registry.problem`'s message,
            e.g. "install the GPU profile (...) or use --rollout-backend transformers".
    """

    target: str | None
    requires: tuple[str, ...] = ()
    config: str | None = None
    planned: str | None = None
    fix: str | None = None


class Unavailable(ImportError):
    """A registry entry that cannot run here: planned but not built, or a required package is missing."""


class Registry(Generic[T]):
    """A named collection of interchangeable implementations.

    Args:
        kind: what is registered, used in error messages (e.g. ``"reward function"``).
        flag: the command-line flag that selects an entry, used in error messages.
        builtins: entries declared by import path (see :class:`Builtin`); each is imported on its
            first :meth:`get`.
    """

    def __init__(self, kind: str, flag: str, builtins: Mapping[str, Builtin] | None = None):
        self.kind = kind
        self.flag = flag
        self.builtins: dict[str, Builtin] = dict(builtins or {})
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers ``obj`` under ``name``.

        Raises:
            KeyError: ``name`` is already registered or declared as a built-in.
        """

        def deco(obj: T) -> T:
            if name in self._entries or name in self.builtins:
                raise KeyError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        """Registered and built-in names, sorted."""
        return sorted(set(self._entries) | set(self.builtins))

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self.builtins or _is_import_path(name)

    def get(self, name: str) -> T:
        """Look ``name`` up, importing a built-in on its first lookup or a ``module:attr`` path.

        Raises:
            KeyError: unknown name; the message lists the valid ones.
            Unavailable: a built-in that is planned but not in this version, or whose required
                packages are missing (the message is :meth:`problem`'s).
            ImportError / AttributeError: an import path (or a built-in's target) that does not resolve.
        """
        if name in self._entries:
            return self._entries[name]
        if name in self.builtins:
            entry = self.builtins[name]
            if entry.target is None or not all(_installed(req)[0] for req in entry.requires):
                raise Unavailable(self.problem(name))  # type: ignore[arg-type]
            obj = import_object(entry.target)
            self._entries[name] = obj
            return obj
        if _is_import_path(name):
            return import_object(name)
        raise KeyError(
            f"unknown {self.kind} {name!r} for {self.flag}; valid: {', '.join(self.names())} "
            f"(or a 'package.module:attr' import path)"
        )

    def resolve(self, name: str, flag: str | None = None) -> T:
        """:meth:`get` for start-up checks (before Ray starts): every failure becomes a :class:`ConfigError`.

        Args:
            name: the registered name or ``package.module:attr`` path.
            flag: the flag that gave ``name``, for the message (default: the registry's :attr:`flag`;
                e.g. ``--custom-rm-path`` for the reward functions).

        Raises:
            ConfigError: an unknown name (the valid ones listed), an unavailable built-in (its
                packages named), or an import path whose module cannot be imported or lacks the
                attribute; the message starts with ``flag`` and ``name``.  Any exception raised while
                importing the module (user code) is reported, chained as the cause.
        """
        flag = flag or self.flag
        try:
            return self.get(name)
        except Unavailable as e:
            raise ConfigError(str(e)) from None
        except KeyError as e:
            raise ConfigError(f"{flag} {name}: not available in this installation ({e.args[0]})") from None
        except Exception as e:  # importing a user's module may raise anything
            raise ConfigError(f"{flag} {name}: cannot be imported here: {type(e).__name__}: {e}") from e

    def config_class(self, name: str) -> type | None:
        """The light side (flag group / checks) of built-in ``name`` (:attr:`Builtin.config`), imported;
        ``None`` for entries without one (registered objects, import paths)."""
        entry = self.builtins.get(name)
        return None if entry is None or entry.config is None else import_object(entry.config)

    def name_of_config(self, cls: type) -> str | None:
        """The built-in whose :attr:`Builtin.config` is ``cls``, or ``None``."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        return next((name for name, entry in self.builtins.items() if entry.config == path), None)

    def problem(self, name: str) -> str | None:
        """Why ``name`` cannot run on this machine, found without importing it; ``None`` if nothing is known wrong.

        - a built-in planned for a later version: says so, and lists its required packages;
        - a built-in with a required package missing or at another version than its pin: every
          requirement as ``"megatron-core 0.16.1 (not installed)"``, ``"megatron-core 0.16.1
          (installed 0.15.0, needs ==0.16.1)"`` or ``"flash-linear-attention 0.6.0 (installed: 0.6.0)"``,
          then the entry's :attr:`Builtin.fix`;
        - an import path whose module cannot be found (:func:`find_module_problem`: the module
          itself is never imported, nor, as a rule, its parent packages).

        An unknown name is left to the flag's own check (``check_name_or_import_path``) and gives ``None``.
        """
        if name in self.builtins:
            entry = self.builtins[name]
            statuses = [_installed(req) for req in entry.requires]
            needs = f"it needs {', '.join(text for _, text in statuses)}"
            if entry.target is None:
                return f"{self.flag} {name} is not in this version yet ({entry.planned or 'planned'})" + (
                    f"; {needs}" if statuses else ""
                )
            if not all(ok for ok, _ in statuses):
                return f"{self.flag} {name} cannot run here: {needs}" + (f"; {entry.fix}" if entry.fix else "")
            return None
        if name in self._entries or not _is_import_path(name):
            return None
        why = find_module_problem(name.partition(":")[0])
        return None if why is None else f"{self.flag} {name} cannot be imported here: {why}"


def find_module_problem(module: str) -> str | None:
    """Why module ``module`` (dotted name) cannot be found; ``None`` when it can.  The module is never imported.

    It is located as the import system would, without running any package's ``__init__``: a
    top-level name with :func:`importlib.util.find_spec` (no parent to import), each submodule
    with :class:`importlib.machinery.PathFinder` in its parent's folders (the parent's spec, or
    its ``__path__`` when it is imported already).  So a module that exists is found with nothing
    imported.  Only when a submodule is not in its parent's folders (a typo, or a package that
    extends its ``__path__`` at import time or has its own finder) does
    :func:`importlib.util.find_spec` give the final word, and that imports the parent packages.
    """
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError) as e:
        return str(e)
    if spec is None:
        return f"no module named {parts[0]!r}"
    for depth in range(1, len(parts)):
        parent, name = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
        loaded = sys.modules.get(parent)
        locations = getattr(loaded, "__path__", None) if loaded is not None else spec.submodule_search_locations
        if locations is None:
            return f"{parent!r} is not a package, so it has no module {name!r}"
        found = importlib.machinery.PathFinder.find_spec(name, list(locations))
        if found is None:
            break  # maybe a search path built at import time, or another finder: the import system decides
        spec = found
    else:
        return None
    try:
        return None if importlib.util.find_spec(module) is not None else f"no module named {module!r}"
    except (ImportError, ValueError) as e:  # a parent package is missing, or not a package
        return str(e)
    except Exception as e:  # noqa: BLE001 - a parent package's own code failed on import
        return f"importing its parent packages raised {type(e).__name__}: {e}"


def _installed(requirement: str) -> tuple[bool, str]:
    """Whether ``"name==pin"`` (or a bare ``"name"``: any version) is met here, and how to say it.

    Returns:
        ``(True, "name pin (installed: X)")`` when the installed version, without its PEP 440
        local label, equals the pin (or there is no pin); ``(False, "name pin (installed X, needs
        ==pin)")`` for another version; ``(False, "name pin (not installed)")``.
    """
    dist, _, pin = requirement.partition("==")
    label = f"{dist} {pin}" if pin else dist
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False, f"{label} (not installed)"
    if pin and version.partition("+")[0] != pin:
        return False, f"{label} (installed {version}, needs =={pin})"
    return True, f"{label} (installed: {version})"


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

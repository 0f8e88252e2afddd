"""Name -> implementation registries (reward functions, advantage estimators, engines, backends, transports).

All entries of one registry share a signature.  A duplicate name raises; an unknown one raises with the
valid ones listed; ``package.module:attr`` is imported on lookup (a user's own implementation).
Built-ins whose modules are heavy are declared by import path (:class:`Builtin`), so importing a
registry imports none of them, and :meth:`Registry.problem` tells at parse time, without importing the
entry, whether it can run here (planned, or a package missing or at another version than its pin).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from typing import Callable, Generic, Mapping, TypeVar

from slime.utils.config import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in entry that a registry knows by name before importing it.

    Attributes:
        target: ``"package.module:attr"`` imported on the first lookup; ``None``: planned, not in this version.
        requires: distributions beyond slime's base, pinned (``"megatron-core==0.16.1"``) or bare (any
            version); checked with ``importlib.metadata`` against the pin without its local label.
        config: ``"package.module:attr"`` of the entry's light side (flag group, parse-time checks).
        planned: for ``target=None``, what is missing.
        fix: the way out when ``requires`` is not met, appended to :meth:`Registry.problem`'s message.
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

    ``kind`` (e.g. ``"reward function"``) and ``flag`` name it in error messages; ``builtins`` are
    declared by import path, each imported on its first :meth:`get`.
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
            Unavailable: a built-in that is planned or whose required packages are missing (:meth:`problem`).
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
        """:meth:`get` for start-up checks: every failure becomes a :class:`ConfigError` naming ``flag`` and ``name``.

        ``flag`` defaults to the registry's.

        Raises:
            ConfigError: an unknown name, an unavailable built-in, or an import path that does not import
                (an exception of the user's module is chained as the cause).
        """
        flag = flag or self.flag
        try:
            return self.get(name)
        except Unavailable as e:
            raise ConfigError(str(e)) from None
        except KeyError as e:
            raise ConfigError(f"{flag} {name}: not available in this installation ({e.args[0]})") from None
        except ModuleNotFoundError as e:
            module = name.partition(":")[0]
            hint = f"; {search_path_hint(module)}" if not_found_itself(module, e) else ""
            raise ConfigError(f"{flag} {name}: cannot be imported here: {type(e).__name__}: {e}{hint}") from e
        except Exception as e:  # importing a user's module may raise anything
            raise ConfigError(f"{flag} {name}: cannot be imported here: {type(e).__name__}: {e}") from e

    def config_class(self, name: str) -> type | None:
        """The imported light side (:attr:`Builtin.config`) of built-in ``name``; ``None`` for entries without one."""
        entry = self.builtins.get(name)
        return None if entry is None or entry.config is None else import_object(entry.config)

    def name_of_config(self, cls: type) -> str | None:
        """The built-in whose :attr:`Builtin.config` is ``cls``, or ``None``."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        return next((name for name, entry in self.builtins.items() if entry.config == path), None)

    def problem(self, name: str) -> str | None:
        """Why ``name`` cannot run here, found without importing it; ``None`` if nothing is known wrong (or unknown).

        A planned built-in; a built-in's requirements, each as ``"megatron-core 0.16.1 (not installed)"``,
        ``"... (installed 0.15.0, needs ==0.16.1)"`` or ``"... (installed: 0.16.1)"``, then :attr:`Builtin.fix`;
        an import path whose module cannot be found (:func:`find_module_problem`).
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
        module = name.partition(":")[0]
        why = find_module_problem(module)
        return None if why is None else f"{self.flag} {name} cannot be imported here: {why}; {search_path_hint(module)}"


def not_found_itself(module: str, error: BaseException) -> bool:
    """Whether ``error`` says that ``module`` (dotted) or a package above it is not on the path, rather than a module
    it imports in turn (a missing dependency of the user's code, which a path hint would not fix)."""
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    return bool(missing) and (module == missing or module.startswith(missing + "."))


def search_path_hint(module: str) -> str:
    """Where Python looked for a user's ``module`` (dotted) that was not found, and how to make it findable: the
    working directory and ``PYTHONPATH`` (the reward workers and Ray actors inherit the driver's path)."""
    top = module.split(".")[0]
    pythonpath = os.environ.get("PYTHONPATH") or "unset"
    return (f"Python looks for {top!r} in the working directory ({os.getcwd()}) and on PYTHONPATH ({pythonpath}): run "
            f"from the folder that holds {top}, or add that folder to PYTHONPATH (the geo3k launcher runs from the "
            "repository, so there only PYTHONPATH works)")


def find_module_problem(module: str) -> str | None:
    """Why module ``module`` (dotted name) cannot be found; ``None`` when it can.  The module is never imported.

    Each submodule is looked up with :class:`importlib.machinery.PathFinder` in its parent's folders, so
    no package ``__init__`` runs; only when that fails (a typo, or a package with its own finder or a
    ``__path__`` built at import time) does :func:`importlib.util.find_spec` decide, importing the parents.
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
        try:
            found = importlib.machinery.PathFinder.find_spec(name, list(locations))
        except KeyError:  # a namespace package's path (no __init__.py) needs its parent in sys.modules:
            break  # the import system decides (importing namespace packages runs no code)
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


def check_function(obj, flag: str, name: str, args: tuple, contract: str) -> None:
    """Check that ``obj`` (what ``flag name`` resolved to) is callable with ``args``, a sample of its arguments.

    An object without an inspectable signature (some builtins) passes: calls will tell.

    Raises:
        ConfigError: naming ``flag`` and ``name``: ``obj`` is not callable, or its signature does not accept
            ``args`` (``contract`` says what it should accept and return).
    """
    if not callable(obj):
        raise ConfigError(f"{flag} {name!r} is a {type(obj).__name__}, not a function")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args)
    except TypeError:
        raise ConfigError(f"{flag} {name!r} has the signature {signature}; {contract}") from None


def _installed(requirement: str) -> tuple[bool, str]:
    """``(met, "name pin (installed: X)" | "name pin (installed X, needs ==pin)" | "name pin (not installed)")``."""
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

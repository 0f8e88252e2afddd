"""Typed config groups and the one bridge between them and ``argparse``.

Each subsystem owns a ``@dataclass`` of its flags, each field declared with :func:`flag`;
:func:`add_group` turns it into an argparse group (``--help`` shows the first line of its docstring)
and :func:`build_group` turns the parsed namespace back into it, running its ``__post_init__`` checks.

Conventions: the flag is ``--`` + the field name with dashes unless ``name=`` says otherwise; a
``bool`` field is a ``store_true`` switch (defaulting to ``True``: also ``--no-...``); ``list`` fields
take ``nargs="+"``; ``int`` / ``float`` show as ``INT`` / ``FLOAT``; ``--help`` appends the default
(:func:`default_text`); no float flag takes ``nan`` or ``inf``.  Errors raise :class:`ConfigError`,
whose message names the flag, the bad value and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shlex
import typing
from typing import Any

from slime.errors import SlimeError


class ConfigError(SlimeError, ValueError):
    """A flag value is invalid. The message names the flag, the value and the fix."""


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    name: str | None = None,
    choices: typing.Sequence[Any] | None = None,
    nargs: str | int | None = None,
    metavar: str | tuple[str, ...] | None = None,
    type: typing.Callable[[str], Any] | None = None,
    default_factory: typing.Callable[[], Any] | None = None,
) -> Any:
    """Declare one config field and the flag that sets it; no ``default`` (nor ``default_factory``): required.

    ``help`` is the ``--help`` text (state the unit); ``name`` the flag spelling when it is not the
    field's; ``choices``, ``nargs``, ``metavar``, ``type`` go to ``argparse.add_argument``.
    """
    metadata = dict(help=help, name=name, choices=choices, nargs=nargs, metavar=metavar, type=type)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    """The ``--flag-name`` of a dataclass field declared with :func:`flag`."""
    return field.metadata.get("name") or "--" + field.name.replace("_", "-")


def _scalar_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


_MENTIONS_DEFAULT = re.compile(r"\bdefaults?\b", re.IGNORECASE)
"""A help text that already says what happens by default (``(default: --rollout-top-p)``)."""


def default_text(value: Any) -> str | None:
    """How ``--help`` writes a default as typed on the command line; ``None`` for ``None``, ``False``, empty lists.

    ``True`` is ``on``, a list its values, a dict compact JSON, a string shell-quoted if need be, a number its ``repr``.
    """
    if value is None or value is False or (isinstance(value, (list, tuple)) and not value):
        return None
    if value is True:
        return "on"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (list, tuple)):
        return " ".join(default_text(v) or repr(v) for v in value)
    if isinstance(value, str):
        return shlex.quote(value)
    return repr(value)


def add_group(parser: argparse.ArgumentParser, cls: type, title: str, description: str | None = None) -> None:
    """Add every field of dataclass ``cls`` as a flag in a new argument group ``title``, with its default in the help.

    Raises:
        TypeError: a field was not declared with :func:`flag`.
    """
    group = parser.add_argument_group(title, description or (cls.__doc__ or "").strip().split("\n")[0])
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name} must be declared with slime.utils.config.flag()")
        md = field.metadata
        tp = _scalar_type(hints[field.name])
        default = None if field.default is dataclasses.MISSING else field.default
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING  # type: ignore[misc]
        kwargs: dict[str, Any] = dict(dest=field.name, help=md["help"])
        if tp is bool:
            if default:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["action"] = "store_true"
            kwargs["default"] = bool(default)
        else:
            origin = typing.get_origin(tp)
            if origin in (list, tuple):
                (elem,) = [a for a in typing.get_args(tp) if a is not Ellipsis][:1] or (str,)
                kwargs["nargs"] = md["nargs"] or "+"
                kwargs["type"] = md["type"] or elem
            else:
                kwargs["type"] = md["type"] or (tp if tp in (int, float, str) else str)
                if md["nargs"] is not None:
                    kwargs["nargs"] = md["nargs"]
            kwargs["default"] = default
            kwargs["required"] = required
            if md["choices"] is not None:
                kwargs["choices"] = md["choices"]
            if md["metavar"] is not None:
                kwargs["metavar"] = md["metavar"]
            elif md["choices"] is None and kwargs["type"] in (int, float):
                kwargs["metavar"] = kwargs["type"].__name__.upper()  # --num-layers INT, not NUM_LAYERS
        action = group.add_argument(flag_name(field), **kwargs)
        shown = None if required else default_text(default)
        if shown is not None and not _MENTIONS_DEFAULT.search(action.help or ""):
            action.help = f"{action.help} (default: {shown.replace('%', '%%')})"  # argparse %-formats help


def build_group(cls: type, namespace: argparse.Namespace) -> Any:
    """Instantiate dataclass ``cls`` from the parsed ``namespace`` (runs its validation).

    Raises:
        ConfigError: a float value (alone or in a list) is NaN or infinite, naming its flag (checked first:
            comparisons let NaN through); or the dataclass's own checks fail.
    """
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
    for field in dataclasses.fields(cls):
        check_finite(flag_name(field), values[field.name])
    return cls(**values)


def check_finite(flag: str, value: Any) -> None:
    """Refuse a NaN or infinite float ``value`` (or one inside a list / tuple) of ``flag``.

    Raises:
        ConfigError: ``<flag> must be a finite number, got nan``.
    """
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{flag} must be a finite number, got {item}")


def to_argv(cfg: Any) -> list[str]:
    """The command-line flags that reproduce dataclass instance ``cfg`` (dicts as JSON)."""
    argv: list[str] = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        name = flag_name(field)
        if isinstance(value, bool):
            if value:
                argv.append(name)
            elif field.default is True:
                argv.append("--no-" + name[2:])
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [name, *map(str, value)]
        elif isinstance(value, dict):
            argv += [name, json.dumps(value)]
        else:
            argv += [name, str(value)]
    return argv


def check_at_least_one(cfg: Any, *names: str) -> None:
    """Refuse a count flag below 1 among the fields ``names`` of ``cfg`` (``None`` is unset).

    Raises:
        ConfigError: ``--<name> must be >= 1, got <value>`` for the first such field.
    """
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_name_or_import_path(flag: str, value: str, names: typing.Sequence[str]) -> None:
    """Check that ``value`` is one of ``names`` or has the form of a ``package.module:attr`` import path (not imported).

    Raises:
        ConfigError: ``value`` is neither; the message names ``flag`` and lists ``names``.
    """
    if value in names:
        return
    module, sep, attr = value.partition(":")
    if sep and module and attr and all(part.isidentifier() for part in module.split(".")) and attr.isidentifier():
        return
    choices = f"one of {', '.join(names)} or " if names else ""
    raise ConfigError(f"{flag} {value!r} is not valid; use {choices}a 'package.module:attr' import path")

"""Typed config groups and the one bridge between them and ``argparse``.

Every subsystem owns a small ``@dataclass`` of its flags, defined next to the code that
uses it (``RolloutConfig`` beside the rollout manager, ``GRPOConfig`` beside the GRPO
math, ...).  Each field is declared with :func:`flag`, which records the help text and,
where needed, the argparse details.  :mod:`slime.arguments` only assembles the
groups: :func:`add_group` turns a dataclass into an argparse argument group (so
``--help`` is grouped), and :func:`build_group` turns the parsed namespace back into the
dataclass, which runs its ``__post_init__`` validation.

Conventions (the same as slime / Megatron flags):

- the flag name is the field name with ``_`` replaced by ``-`` (``rollout_batch_size``
  -> ``--rollout-batch-size``), unless ``name=`` overrides it;
- a ``bool`` field defaulting to ``False`` is a ``store_true`` switch; one defaulting to
  ``True`` also gets a ``--no-...`` form;
- ``list[...]`` fields take ``nargs="+"`` unless ``nargs`` says otherwise;
- ``int`` / ``float`` values are shown as ``INT`` / ``FLOAT`` in ``--help`` unless ``metavar`` says otherwise;
- ``--help`` ends each flag's text with its default, `` (default: X)``, unless the default is
  ``None``, ``False`` or empty, or the text already speaks of a default (see :func:`default_text`);
- every float value must be finite: ``nan``, ``inf`` and ``-inf`` (which ``float()`` accepts) are
  refused for every flag by :func:`build_group`, naming the flag.  No flag takes them: a flag
  that can mean "no limit" says so with a finite value or by being unset (``--clip-grad 0``,
  ``--eps-clip-high`` unset).

Validation errors raise :class:`ConfigError`, whose message names the flag, the bad value
and the fix.
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


class ConfigError(ValueError):
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
    """Declare one config field and the command-line flag that sets it.

    Args:
        default: default value; omit (with no ``default_factory``) to make the flag required.
        help: the ``--help`` text. State the unit (tokens, samples, seconds, ...).
        name: the flag spelling when it is not ``--`` + field name with dashes.
        choices, nargs, metavar, type: passed to ``argparse.add_argument``.
        default_factory: for mutable defaults (lists, dicts).
    """
    metadata = dict(help=help, name=name, choices=choices, nargs=nargs, metavar=metavar, type=type)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    """The ``--flag-name`` of a dataclass field declared with :func:`flag`."""
    return field.metadata.get("name") or "--" + field.name.replace("_", "-")


def _scalar_type(tp: Any) -> Any:
    """Strip ``Optional[...]`` / ``X | None`` and return the remaining type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


_MENTIONS_DEFAULT = re.compile(r"\bdefaults?\b", re.IGNORECASE)
"""A help text that already says what happens by default (``(default: --rollout-top-p)``)."""


def default_text(value: Any) -> str | None:
    """How ``--help`` writes a default, in command-line form; ``None`` when there is none to show.

    ``None``, ``False`` and empty lists show nothing (the flag is simply off / unset); ``True``
    is ``on``; a list is its values separated by spaces (as typed after the flag); a dict is
    compact JSON (as typed for JSON flags, ``{}`` included); strings are shell-quoted only when
    they need it; numbers are Python's ``repr`` (``1e-06``, ``0.0``).
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
    """Add every field of dataclass ``cls`` as a flag in a new argument group ``title``.

    Each flag's help gets `` (default: X)`` appended (:func:`default_text`), unless its text
    already mentions a default.

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
        ConfigError: a float value (alone or in a list) is NaN or infinite, naming its flag (checked
            before the dataclass's own checks, whose comparisons NaN would slip through); or the
            dataclass's own checks fail.
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
    """The command-line flags that reproduce dataclass instance ``cfg`` (for logs and resume).

    ``dict`` values (JSON flags such as ``--multimodal-keys``) are written as JSON.
    """
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
    """Refuse a count flag below 1: for each field of the config dataclass ``cfg`` in
    ``names`` that is set (not None) and < 1.

    Raises:
        ConfigError: ``--<name> must be >= 1, got <value>`` for the first such field.
    """
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_name_or_import_path(flag: str, value: str, names: typing.Sequence[str]) -> None:
    """Check that ``value`` is one of ``names`` or a ``package.module:attr`` import path.

    Only the form of an import path is checked here; importing it is left to the code that
    uses it (the import may need packages that exist only on the GPU machines).

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

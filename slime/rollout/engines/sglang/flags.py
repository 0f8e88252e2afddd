"""The SGLang flags, all of them here (importable without SGLang): the pass-through group (SGLANG_ARGS) and slime's
own ``--sglang-*`` settings of the client.

SGLang has a few hundred server arguments and slime does not re-declare them: every ``--sglang-<name>`` flag on the
command line is collected as is by :func:`extract_sglang_args` into :class:`SGLangConfig` and handed to SGLang as
``--<name>`` (upstream slime's convention), except the ones in :data:`SLIME_OWNED` (upstream slime's names for
client-side settings, read by the engine and not passed on: :func:`server_concurrency`, :func:`requests_per_call`).
The parse-time checks of the server arguments: :mod:`slime.rollout.engines.sglang.config`.
"""

from __future__ import annotations

import dataclasses
import re

from slime.utils.config import ConfigError

SGLANG_HELP = (
    "SGLang server arguments, passed through. Any SGLang server argument, written --sglang-<name> [VALUE ...], "
    "is passed to every SGLang engine as --<name> [VALUE ...]; e.g. --sglang-mem-fraction-static 0.7 "
    "--sglang-cuda-graph-bs 1 2 4 --sglang-disable-custom-all-reduce. slime sets the model path "
    "(--hf-checkpoint), the tensor-parallel size (--rollout-num-gpus-per-engine), the seed (--rollout-seed), "
    "host and port itself, and --dtype bfloat16 unless --sglang-dtype is given. Each server gets a per-run key "
    "of its own (--sglang-api-key / --sglang-admin-api-key are refused). --sglang-server-concurrency N "
    "(default 512) and --sglang-requests-per-call N (default 32) are slime's, not the server's: the requests "
    "kept in flight at each engine, and how many of them go in one batched /generate call."
)

SGLANG_PREFIX = "--sglang-"

SGLANG_ARGS_SET_BY_SLIME = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "tensor_parallel_size": "--rollout-num-gpus-per-engine",  # SGLang's other name of --tp-size
    "random_seed": "--rollout-seed",
    "port": "(slime assigns a free port to each engine)",
    "host": "(slime assigns each engine its node's address)",
}
"""SGLang server arguments that slime derives from its own flags; ``--sglang-<name>`` for them is refused."""

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_SGLANG_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

SGLangValue = str | list[str] | bool


@dataclasses.dataclass
class SGLangConfig:
    """SGLang server arguments (SGLANG_ARGS), passed through: --sglang-<name> [VALUE ...] becomes SGLang's --<name>.

    ``server_args`` maps the SGLang argument name (underscores) to its value as typed: a switch
    with no value is ``True``, one value is a ``str``, several are a ``list[str]``; SGLang's own
    parser converts the types.  E.g. ``--sglang-mem-fraction-static 0.7`` ->
    ``{"mem_fraction_static": "0.7"}``, ``--sglang-cuda-graph-bs 1 2 4`` -> ``["1", "2", "4"]``,
    ``--sglang-disable-custom-all-reduce`` -> ``True``.
    """

    server_args: dict[str, SGLangValue] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in self.server_args:
            # SGLang's argparse expands a unique prefix (allow_abbrev): --sglang-tp 2 would be its --tp-size 2
            full = name if name in SGLANG_ARGS_SET_BY_SLIME else next(
                (n for n in SGLANG_ARGS_SET_BY_SLIME if n.startswith(name)), None)
            if full is not None:
                source = SGLANG_ARGS_SET_BY_SLIME[full]
                fix = f"use {source}" if source.startswith("--") else source.strip("()")
                what = "" if full == name else f" (SGLang's parser reads it as --{full.replace('_', '-')})"
                raise ConfigError(f"--sglang-{name.replace('_', '-')}{what} is set by slime, not passed through: {fix}")

    def server_argv(self) -> list[str]:
        """The SGLang server flags, e.g. ``["--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2"]``."""
        return _render(self.server_args, "--")

    def to_argv(self) -> list[str]:
        """The slime flags that reproduce this config, e.g. ``["--sglang-mem-fraction-static", "0.7"]``."""
        return _render(self.server_args, SGLANG_PREFIX)


def _render(server_args: dict[str, SGLangValue], prefix: str) -> list[str]:
    """Flags for ``server_args``: ``[--name, value]``, or ``--name=value`` for one value that starts with
    ``-`` (``--sglang-chat-template=-x``, ``-1e-3``): argparse would read ``-x`` as the next flag, both in
    SGLang's parser and in :func:`extract_sglang_args` reading ``command.sh`` back."""
    argv: list[str] = []
    for name, value in server_args.items():
        flag = prefix + name.replace("_", "-")
        if isinstance(value, list):
            argv += [flag, *value]
        elif value is True:
            argv.append(flag)
        elif value.startswith("-"):
            argv.append(f"{flag}={value}")
        else:
            argv += [flag, value]
    return argv


def _is_value(token: str) -> bool:
    """A token that is a flag's value rather than the next flag (negative numbers are values)."""
    return not token.startswith("-") or bool(_NEGATIVE_NUMBER.match(token))


def extract_sglang_args(argv: list[str]) -> tuple[SGLangConfig, list[str]]:
    """Split ``--sglang-*`` flags, with their values, out of a command line.

    A flag's values are the tokens up to the next one that starts with ``-`` (negative numbers
    such as ``-1`` count as values); ``--sglang-name=value`` is one value.

    Args:
        argv: the full command line (without the program name).

    Returns:
        ``(SGLangConfig, remaining argv)``; the remaining tokens keep their order.

    Raises:
        ConfigError: a malformed name (``--sglang-`` alone, capitals, underscores), a flag given
            twice, or a flag that slime sets itself (see ``SGLANG_ARGS_SET_BY_SLIME``).
    """
    server_args: dict[str, SGLangValue] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith(SGLANG_PREFIX):
            rest.append(token)
            continue
        name, has_inline_value, inline_value = token[len(SGLANG_PREFIX) :].partition("=")
        if not _SGLANG_NAME.match(name):
            raise ConfigError(
                f"{token!r} is not a valid SGLang flag; write --sglang-<server-arg> with the SGLang name in "
                "lower-case words joined by '-', e.g. --sglang-mem-fraction-static 0.7"
            )
        values = [inline_value] if has_inline_value else []
        while not has_inline_value and i < len(argv) and _is_value(argv[i]):
            values.append(argv[i])
            i += 1
        key = name.replace("-", "_")
        if key in server_args:
            raise ConfigError(f"{SGLANG_PREFIX}{name} is given twice; keep one")
        server_args[key] = True if not values else values[0] if len(values) == 1 else values
    return SGLangConfig(server_args), rest


DEFAULT_SERVER_CONCURRENCY = 512
"""Requests the engine keeps in flight at one server (upstream slime's ``--sglang-server-concurrency`` default)."""
MAX_SERVER_CONCURRENCY = 512
"""Threads of an engine actor for ``generate`` (``SGLangEngine.max_concurrent_calls``): the most calls in flight."""
DEFAULT_REQUESTS_PER_CALL = 32
"""Requests in one batched ``/generate`` call (``--sglang-requests-per-call``), see :data:`SLIME_OWNED`."""

SLIME_OWNED = {
    "server_concurrency": "requests slime keeps in flight at each engine (its capacity); the server queues "
    "what it cannot run at once (--sglang-max-running-requests)",
    "requests_per_call": "requests sent in one batched /generate call (at most the engine's capacity): SGLang "
    "tokenises a batch's prompts one after the other and schedules each as soon as it is ready, whereas many "
    "single-request calls arriving at once are pre-processed side by side and reach the scheduler together "
    "(on the H200, 64 image prompts sent singly waited 2 s before decoding began); a call returns when its last "
    "request ends, so smaller calls free the group's window sooner",
}
"""``--sglang-*`` names that configure slime's client, not the server."""


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def slime_owned_args(sglang: SGLangConfig) -> tuple[dict[str, str], list[str]]:
    """Split ``--sglang-*`` flags into slime's own (:data:`SLIME_OWNED`) and the server's.

    Returns:
        ``({name: value}, SGLang server argv)``.
    """
    owned = {k: v for k, v in sglang.server_args.items() if k in SLIME_OWNED}
    rest = SGLangConfig({k: v for k, v in sglang.server_args.items() if k not in SLIME_OWNED})
    return owned, _render(rest.server_args, "--")


def _owned_int(sglang: SGLangConfig, name: str, default: int, top: int, hint: str) -> int:
    value = sglang.server_args.get(name, str(default))
    try:
        number = int(value) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is None or not 1 <= number <= top:
        raise ConfigError(f"--sglang-{_dashed(name)} must be one integer in 1..{top}, got {value!r}; {hint}")
    return number


def server_concurrency(sglang: SGLangConfig) -> int:
    """``--sglang-server-concurrency`` (default :data:`DEFAULT_SERVER_CONCURRENCY`).

    Raises:
        ConfigError: not one integer in 1..:data:`MAX_SERVER_CONCURRENCY`.
    """
    return _owned_int(sglang, "server_concurrency", DEFAULT_SERVER_CONCURRENCY, MAX_SERVER_CONCURRENCY,
                      "e.g. 512 (the server queues what it cannot run at once)")


def default_requests_per_call(capacity: int) -> int:
    """:data:`DEFAULT_REQUESTS_PER_CALL`, cut to an engine's ``capacity`` (``--sglang-server-concurrency``)."""
    return min(DEFAULT_REQUESTS_PER_CALL, capacity)


def requests_per_call(sglang: SGLangConfig) -> int:
    """``--sglang-requests-per-call`` (default :func:`default_requests_per_call`).

    Raises:
        ConfigError: not one integer in 1..``--sglang-server-concurrency``.
    """
    capacity = server_concurrency(sglang)
    return _owned_int(sglang, "requests_per_call", default_requests_per_call(capacity), capacity,
                      f"e.g. {default_requests_per_call(capacity)} (at most --sglang-server-concurrency; 1 sends "
                      "every request in a call of its own)")

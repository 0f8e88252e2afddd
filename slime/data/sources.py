"""Dataset rows from a file, a folder or the Hugging Face hub, as an Arrow table.

``--prompt-data`` / ``--eval-prompt-data`` name a ``.parquet`` or ``.jsonl`` file; a folder holding
``<split>.parquet`` (or ``.jsonl``; ``train`` for training, ``test`` for evaluation); or else a Hugging
Face dataset name for ``datasets.load_dataset(name, split=split)``.  ``NAME@split`` (or ``FOLDER@split``)
picks another split.  Labels keep their text as written (:func:`read_jsonl`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slime.errors import SlimeError
from slime.utils.config import ConfigError

LOCAL_SUFFIXES = (".parquet", ".jsonl")
"""File types ``--prompt-data`` reads directly."""

LISTED_ROWS = 10
"""Bad rows named in one error message; the rest are counted."""


class DatasetError(SlimeError, ValueError):
    """A dataset row or file cannot be used; the message names the file, row and field."""


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where the rows of one split live: a local ``path`` or a ``hub_name`` (exactly one), and the split."""

    path: str | None
    """Local ``.parquet`` / ``.jsonl`` file."""
    hub_name: str | None
    """Name for ``datasets.load_dataset``."""
    split: str
    """Split of the hub dataset (or of the folder the file was picked from)."""

    def __str__(self) -> str:
        return self.path if self.path is not None else f"{self.hub_name}@{self.split}"


def resolve_source(spec: str, *, default_split: str, flag_name: str = "--prompt-data") -> DataSource:
    """What ``spec`` names; ``default_split`` applies to a folder or hub name without ``@split``.

    Raises:
        ConfigError: a path that looks local (a .parquet / .jsonl suffix, or ``/``, ``.``, ``~``) does
            not exist, a file of another type, or a folder without ``<split>.parquet`` / ``.jsonl``.
    """
    location, split = spec, default_split
    if "@" in spec and not os.path.exists(spec):
        location, split = spec.rsplit("@", 1)
    path = os.path.expanduser(location)
    if os.path.isdir(path):
        for suffix in LOCAL_SUFFIXES:
            candidate = os.path.join(path, split + suffix)
            if os.path.isfile(candidate):
                return DataSource(path=candidate, hub_name=None, split=split)
        raise ConfigError(
            f"{flag_name} {spec!r}: the folder has no {split}.parquet or {split}.jsonl (it holds "
            f"{sorted(os.listdir(path))}); add the file, or name a file or FOLDER@split"
        )
    if os.path.isfile(path):
        if not path.endswith(LOCAL_SUFFIXES):
            raise ConfigError(f"{flag_name} {spec!r}: unsupported file type; use a .parquet or .jsonl file")
        return DataSource(path=path, hub_name=None, split=split)
    if path.endswith(LOCAL_SUFFIXES) or location.startswith(("/", ".", "~")):
        raise ConfigError(f"{flag_name} {spec!r}: file not found ({os.path.abspath(path)}); fix the path")
    return DataSource(path=None, hub_name=location, split=split)


@dataclasses.dataclass
class LoadedTable:
    """Rows of one dataset split as an Arrow table (images in their stored form), its source, and the
    folder that relative image paths resolve against (``None`` for hub data).
    """

    table: pa.Table
    source: DataSource
    base_dir: str | None


def load_table(
    spec: str, *, default_split: str, flag_name: str = "--prompt-data", text_columns: Collection[str] = ()
) -> LoadedTable:
    """Load the rows that ``spec`` names (parquet memory-mapped, :func:`read_jsonl`, or the hub, images undecoded).

    ``text_columns``: columns whose .jsonl numbers keep their text (the label).

    Raises:
        ConfigError: see :func:`resolve_source`; or the hub dataset cannot be loaded.
        DatasetError: a malformed .jsonl line or column, or a file that is not parquet / UTF-8 text.
    """
    source = resolve_source(spec, default_split=default_split, flag_name=flag_name)
    if source.path is None:
        return LoadedTable(table=_read_hub(source, spec=spec, flag_name=flag_name), source=source, base_dir=None)
    try:
        if source.path.endswith(".parquet"):
            table = pq.read_table(source.path, memory_map=True)
        else:
            table = read_jsonl(source.path, text_columns=text_columns)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        kind = "a parquet" if source.path.endswith(".parquet") else "a UTF-8 JSON-lines"
        raise DatasetError(f"{flag_name} {spec}: {source.path} cannot be read as {kind} file ({e})") from None
    except DatasetError as e:  # read_jsonl names the file and line; add the flag
        raise DatasetError(f"{flag_name} {spec}: {e}") from None
    return LoadedTable(table=table, source=source, base_dir=os.path.dirname(os.path.abspath(source.path)))


def read_jsonl(path: str, *, text_columns: Collection[str] = ()) -> pa.Table:
    """A JSON-lines file (blank lines ignored) as an Arrow table: every key of any line a column, null where missing.

    In ``text_columns`` a number is kept as the token written (``3.50`` -> ``"3.50"``, not ``3.5``), so a
    column of ``3`` and ``3.5`` does not turn ``3`` into ``"3.0"``.

    Raises:
        DatasetError: a line that is not a JSON object (with its number), or a column whose values cannot
            share one Arrow type (naming it).
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {line_number}: invalid JSON ({e}); fix or remove the line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}")
            if any(_is_json_number(row.get(column)) for column in text_columns):
                # Parse again with every number kept as its token; only the text columns take it.
                as_written = json.loads(line, parse_int=str, parse_float=str, parse_constant=str)
                for column in text_columns:
                    if _is_json_number(row.get(column)):
                        row[column] = as_written[column]
            rows.append(row)
    names = list(dict.fromkeys(name for row in rows for name in row))
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([row.get(name) for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DatasetError(
                f"{path}: column {name!r} holds values of different types across lines ({e}); make them agree"
            ) from None
    return pa.table(columns)


def _is_json_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_hub(source: DataSource, *, spec: str, flag_name: str) -> pa.Table:
    import datasets  # heavy; only needed for hub datasets

    try:
        dataset = datasets.load_dataset(source.hub_name, split=source.split)
    except Exception as e:  # the hub client raises many types (offline, 404, bad split, ...)
        raise ConfigError(
            f"{flag_name} {spec!r}: not a local file or folder, and datasets.load_dataset({source.hub_name!r}, "
            f"split={source.split!r}) failed: {type(e).__name__}: {e}"
        ) from e
    # The Arrow view is the stored form: Image columns stay {bytes, path} structs, not decoded here.
    return dataset.with_format("arrow")[:]


def list_rows(descriptions: list[str], total: int, limit: int = LISTED_ROWS) -> str:
    """``"a; b; c"``, at most ``limit`` of ``descriptions``, then ``"; and N more"`` up to ``total`` rows."""
    shown = "; ".join(descriptions[:limit])
    more = total - min(len(descriptions), limit)
    return shown + (f"; and {more} more" if more > 0 else "")

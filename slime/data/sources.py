"""Dataset rows from a file, a folder or the Hugging Face hub, as an Arrow table.

Where rows come from (``--prompt-data``, ``--eval-prompt-data``; :func:`load_table`):

- a local ``.parquet`` or ``.jsonl`` file;
- a folder holding ``<split>.parquet`` (or ``<split>.jsonl``): ``train`` for training,
  ``test`` for evaluation (the bundled ``examples/geo3k_vlm/data``);
- otherwise a Hugging Face dataset name for ``datasets.load_dataset(name, split=split)``,
  e.g. ``chenhegu/geo3k_imgurl`` (what the launcher's ``SLIME_SCRIPT_DATASET_NAME``
  drives).  ``NAME@split`` (and ``FOLDER@split``) picks another split.

Labels are strings: a .jsonl label keeps its text as written, numbers included
(:func:`read_jsonl`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slime.utils.config import ConfigError

LOCAL_SUFFIXES = (".parquet", ".jsonl")
"""File types ``--prompt-data`` reads directly."""

LISTED_ROWS = 10
"""Bad rows named in one error message; the rest are counted."""


class DatasetError(ValueError):
    """A dataset row or file cannot be used; the message names the file, row and field."""


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where the rows of one split live: a local file, or a Hugging Face dataset name and split.

    Exactly one of ``path`` and ``hub_name`` is set.
    """

    path: str | None
    """Local ``.parquet`` / ``.jsonl`` file."""
    hub_name: str | None
    """Name for ``datasets.load_dataset``."""
    split: str
    """Split of the hub dataset (or of the folder the file was picked from)."""

    def __str__(self) -> str:
        return self.path if self.path is not None else f"{self.hub_name}@{self.split}"


def resolve_source(spec: str, *, default_split: str, flag_name: str = "--prompt-data") -> DataSource:
    """Decide what ``spec`` names (see the module docstring for the accepted forms).

    Args:
        spec: the ``--prompt-data`` / ``--eval-prompt-data`` value.
        default_split: the split of a folder or hub dataset when ``spec`` has no ``@split``
            (``"train"`` for training, ``"test"`` for evaluation).
        flag_name: the flag that carried ``spec``, for error messages.

    Raises:
        ConfigError: a path that looks local (ends in .parquet / .jsonl, or starts with
            ``/``, ``.`` or ``~``) does not exist, a file of another type, or a folder
            without ``<split>.parquet`` / ``<split>.jsonl``.  Anything else is taken as a
            hub name (checked when loaded).
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
    """Rows of one dataset split, as an Arrow table, with where they came from.

    Attributes:
        table: the rows; image columns keep their stored form (e.g. ``{bytes, path}``
            structs), decoded later one row at a time.
        source: what was loaded (its ``str`` is used in messages).
        base_dir: folder that relative image paths resolve against (the file's folder;
            ``None`` for hub datasets).
    """

    table: pa.Table
    source: DataSource
    base_dir: str | None


def load_table(
    spec: str, *, default_split: str, flag_name: str = "--prompt-data", text_columns: Collection[str] = ()
) -> LoadedTable:
    """Load the rows that ``spec`` names (resolved by :func:`resolve_source`).

    Local files are read with pyarrow (parquet memory-mapped) or :func:`read_jsonl`; hub
    datasets through ``datasets.load_dataset(name, split=split)`` (which uses the
    ``datasets`` cache), with their Image columns read undecoded.

    Args:
        spec, default_split, flag_name: see :func:`resolve_source`.
        text_columns: columns whose JSON numbers keep their text in a .jsonl file (the
            label column; see :func:`read_jsonl`).  Parquet and hub data keep their stored types.

    Raises:
        ConfigError: see :func:`resolve_source`; or the hub dataset cannot be loaded (the
            message carries the ``datasets`` error).
        DatasetError: a malformed .jsonl line, or a .jsonl column whose values cannot share one
            type; or a file that is not parquet / UTF-8 text (the message names the flag and file).
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
    """Read a JSON-lines file (one JSON object per line; blank lines ignored) into an Arrow table.

    The columns are every key that appears on any line, in order of first appearance; a
    line without a key has null there.  Each column's type is inferred from all its values.

    In ``text_columns`` a value is kept *as written*: a JSON string is its decoded text
    (``"3"`` -> ``3``), and a JSON number is its token exactly as it appears on the line,
    not a float or int re-formatted (``3`` -> ``3``, ``3.50`` -> ``3.50``, ``1e-3`` ->
    ``1e-3``, ``-0`` -> ``-0``; likewise Python's ``NaN`` / ``Infinity`` extensions).
    Without this, a column holding both ``3`` and ``3.5`` becomes float64 and ``3`` reads
    back as ``"3.0"``.  Other JSON values (``true``, lists, objects) are left as parsed.

    Raises:
        DatasetError: a line that is not valid JSON or not an object (the message gives the
            line number), or a column whose values cannot share one Arrow type (it names the column).
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
    """Whether ``json.loads`` produced ``value`` from a JSON number (bool is a JSON literal, not a number)."""
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

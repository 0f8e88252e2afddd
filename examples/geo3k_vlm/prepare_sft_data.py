"""Write Geometry3K rows in the SFT format of the geo3k VLM recipe.

The recipe's README (section "Data Preparation (For SFT Training)") formats each row for
SFT by adding a ``messages`` column: a user turn holding the problem text, ``<image>``
placeholder included, and an assistant turn ``Answer: \\boxed{<answer>}``.  Every other
column, the images included, is kept as it is.  This script does the same for any source
that ``--prompt-data`` accepts:

- a Hugging Face dataset name (``chenhegu/geo3k_imgurl``, the recipe's default), read with
  ``datasets.load_dataset(name, split=--split)``;
- a local ``.parquet`` / ``.jsonl`` file, or a folder holding ``<split>.parquet``
  (e.g. the bundled ``examples/geo3k_vlm/data``).

The output is written with ``datasets.Dataset.to_parquet``, so it keeps the Hugging Face
feature metadata (``images`` stays a list of ``Image`` features); ``--output`` must be a
``.parquet`` path.

Bad input is an error, never a silently dropped or malformed row:

- a row whose answer is null, empty or blank (which would become ``Answer: \\boxed{}`` or
  ``Answer: \\boxed{None}``), or is not a string or number, or whose problem is not a
  string, stops the script before anything is written; the message names the bad rows
  (index and id, the first 10, then a count).  Fix or filter the data and run again;
- an unreadable or empty parquet file, an empty split, and a .jsonl line that is not a
  JSON object are errors naming the file (and the line).

A number answer is written with ``str`` (a parquet float64 ``3.0`` gives ``\\boxed{3.0}``);
a .jsonl answer keeps its text as written (``1e-3`` stays ``1e-3``, see
:func:`slime.data.sources.read_jsonl`).  On good data the output equals the README snippet's.

Usage::

    python examples/geo3k_vlm/prepare_sft_data.py --input chenhegu/geo3k_imgurl --split train \\
        --output /root/datasets/geo3k_imgurl/train_formatted.parquet
    python examples/geo3k_vlm/prepare_sft_data.py --input examples/geo3k_vlm/data --output /tmp/sft.parquet
"""

from __future__ import annotations

import argparse
import os
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from slime.data.sources import DatasetError, list_rows, read_jsonl, resolve_source
from slime.utils.config import ConfigError


def format_answer(answer: str) -> str:
    """The assistant turn of the recipe: ``Answer: \\boxed{<answer>}`` (``answer`` inserted verbatim)."""
    return f"Answer: \\boxed{{{answer}}}"


def sft_messages(problem: str, answer: str) -> list[dict[str, str]]:
    """The two-turn conversation of one row: the problem as the user turn, the boxed answer as the assistant turn."""
    return [{"role": "user", "content": problem}, {"role": "assistant", "content": format_answer(answer)}]


def load_split(spec: str, split: str, answer_key: str = "answer") -> datasets.Dataset:
    """Load ``spec`` (hub name, file or folder; ``NAME@split`` overrides ``split``) as a ``datasets.Dataset``.

    A .jsonl file is read with :func:`slime.data.sources.read_jsonl` (``answer_key`` keeps its
    text as written); a parquet file with ``datasets.Dataset.from_parquet`` (HF feature
    metadata kept).

    Raises:
        ConfigError: a local path that does not exist, or a folder without ``<split>.parquet``
            / ``<split>.jsonl`` (see :func:`slime.data.sources.resolve_source`).
        DatasetError: a parquet file that cannot be read, a .jsonl line that is not a JSON
            object (the message gives the line), or no rows at all.
    """
    source = resolve_source(spec, default_split=split, flag_name="--input")
    if source.hub_name is not None:
        dataset = datasets.load_dataset(source.hub_name, split=source.split)
    elif source.path.endswith(".parquet"):
        try:
            num_rows = pq.read_metadata(source.path).num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"--input {spec!r}: {source.path} is not a readable parquet file ({e})") from None
        if num_rows == 0:  # Dataset.from_parquet fails on it with a bare DatasetGenerationError
            raise DatasetError(f"--input {spec!r}: {source.path} has no rows")
        dataset = datasets.Dataset.from_parquet(source.path)
    else:
        try:
            dataset = datasets.Dataset(read_jsonl(source.path, text_columns=(answer_key,)))
        except DatasetError as e:  # names the file and line
            raise DatasetError(f"--input {spec!r}: {e}") from None
    if len(dataset) == 0:
        raise DatasetError(f"--input {spec!r}: {source} has no rows")
    return dataset


def add_messages(
    dataset: datasets.Dataset, problem_key: str = "problem", answer_key: str = "answer", *, name: str = "the data"
) -> datasets.Dataset:
    """``dataset`` with a ``messages`` column appended (see :func:`sft_messages`); other columns unchanged.

    Only the two text columns are read, so images are passed through without being decoded.
    ``name`` says in error messages where the rows came from.

    Raises:
        ValueError: ``problem_key`` or ``answer_key`` is not a column (the message lists the columns).
        DatasetError: rows with a missing, empty or blank answer, an answer that is not a
            string or number, or a problem that is not a string (see :func:`check_rows`).
    """
    for flag_name, key in (("--problem-key", problem_key), ("--answer-key", answer_key)):
        if key not in dataset.column_names:
            raise ValueError(f"{flag_name} {key!r}: no such column; the data has {dataset.column_names}")
    check_rows(dataset, problem_key, answer_key, name=name)
    return dataset.map(
        lambda problem, answer: {"messages": sft_messages(problem, answer)},
        input_columns=[problem_key, answer_key],
    )


def check_rows(dataset: datasets.Dataset, problem_key: str, answer_key: str, *, name: str = "the data") -> None:
    """Refuse rows that cannot make an SFT example (only the two text columns are read; ``name`` is for messages).

    Raises:
        DatasetError: naming the first :data:`~slime.data.sources.LISTED_ROWS` bad rows
            (index, and id when the data has an ``id`` column) and counting the rest.
    """
    ids = list(dataset["id"]) if "id" in dataset.column_names else None
    bad = []
    for row, (problem, answer) in enumerate(zip(dataset[problem_key], dataset[answer_key])):
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            reason = f"--answer-key {answer_key!r} is {answer!r}"
        elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            reason = f"--answer-key {answer_key!r} is {type(answer).__name__} {answer!r:.80}, not text or a number"
        elif not isinstance(problem, str):
            reason = f"--problem-key {problem_key!r} is {problem!r:.80}, not text"
        else:
            continue
        bad.append(f"row {row}" + (f" (id {ids[row]})" if ids is not None else "") + f": {reason}")
    if bad:
        raise DatasetError(
            f"{name}: {len(bad)} of {len(dataset)} rows cannot be formatted: {list_rows(bad, len(bad))}. "
            "Fix or remove these rows (nothing was written)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Add the SFT `messages` column (user problem, assistant 'Answer: \\boxed{answer}') to geo3k rows "
        "and write them to parquet.",
    )
    parser.add_argument(
        "--input",
        default="chenhegu/geo3k_imgurl",
        help="Hugging Face dataset name, local .parquet/.jsonl file, or folder with <split>.parquet "
        "(default: %(default)s).",
    )
    parser.add_argument("--split", default="train", help="split to convert (default: %(default)s)")
    parser.add_argument("--output", required=True, help="output path, ending in .parquet; its folder is created")
    parser.add_argument("--problem-key", default="problem", help="column with the problem text (default: %(default)s)")
    parser.add_argument("--answer-key", default="answer", help="column with the answer (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.output.endswith(".parquet"):
        parser.error(f"--output {args.output!r}: this script writes parquet; give a path ending in .parquet")

    try:
        dataset = load_split(args.input, args.split, args.answer_key)
        dataset = add_messages(dataset, args.problem_key, args.answer_key, name=f"--input {args.input!r}")
    except (ConfigError, ValueError) as e:  # DatasetError is a ValueError
        parser.error(str(e))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    dataset.to_parquet(args.output)
    print(f"wrote {len(dataset)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

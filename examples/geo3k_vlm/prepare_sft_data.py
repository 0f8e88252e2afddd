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
feature metadata (``images`` stays a list of ``Image`` features).

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

from slime.utils.config import ConfigError
from slime.utils.data import resolve_source


def format_answer(answer: str) -> str:
    """The assistant turn of the recipe: ``Answer: \\boxed{<answer>}`` (``answer`` inserted verbatim)."""
    return f"Answer: \\boxed{{{answer}}}"


def sft_messages(problem: str, answer: str) -> list[dict[str, str]]:
    """The two-turn conversation of one row: the problem as the user turn, the boxed answer as the assistant turn."""
    return [{"role": "user", "content": problem}, {"role": "assistant", "content": format_answer(answer)}]


def load_split(spec: str, split: str) -> datasets.Dataset:
    """Load ``spec`` (hub name, file or folder; ``NAME@split`` overrides ``split``) as a ``datasets.Dataset``.

    Raises:
        ConfigError: a local path that does not exist, or a folder without ``<split>.parquet``
            / ``<split>.jsonl`` (see :func:`slime.utils.data.resolve_source`).
    """
    source = resolve_source(spec, default_split=split, flag_name="--input")
    if source.hub_name is not None:
        return datasets.load_dataset(source.hub_name, split=source.split)
    if source.path.endswith(".parquet"):
        return datasets.Dataset.from_parquet(source.path)
    return datasets.Dataset.from_json(source.path)


def add_messages(dataset: datasets.Dataset, problem_key: str = "problem", answer_key: str = "answer") -> datasets.Dataset:
    """``dataset`` with a ``messages`` column appended (see :func:`sft_messages`); other columns unchanged.

    Only the two text columns are read, so images are passed through without being decoded.

    Raises:
        ValueError: ``problem_key`` or ``answer_key`` is not a column (the message lists the columns).
    """
    for flag_name, key in (("--problem-key", problem_key), ("--answer-key", answer_key)):
        if key not in dataset.column_names:
            raise ValueError(f"{flag_name} {key!r}: no such column; the data has {dataset.column_names}")
    return dataset.map(
        lambda problem, answer: {"messages": sft_messages(problem, answer)},
        input_columns=[problem_key, answer_key],
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
    parser.add_argument("--output", required=True, help="output .parquet path; its folder is created")
    parser.add_argument("--problem-key", default="problem", help="column with the problem text (default: %(default)s)")
    parser.add_argument("--answer-key", default="answer", help="column with the answer (default: %(default)s)")
    args = parser.parse_args(argv)

    try:
        dataset = add_messages(load_split(args.input, args.split), args.problem_key, args.answer_key)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    dataset.to_parquet(args.output)
    print(f"wrote {len(dataset)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

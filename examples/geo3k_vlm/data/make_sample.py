"""Write the bundled Geometry3K sample (``train.parquet``, ``test.parquet``) next to this file.

The sample is a fixed random subset of the team's Geometry3K parquet files (see
``SOURCE.md`` here for where those come from).  The pick is reproducible: for each split,
``numpy.random.default_rng(seed).choice(num_rows, size, replace=False)``, sorted, so the
chosen rows keep their order in the source file.  Rows are copied unchanged (the original
PNG bytes are not re-encoded), and the Hugging Face ``datasets`` feature metadata stored in
the parquet schema is kept, so ``datasets`` still reads ``images`` as a list of ``Image``
features.

Usage::

    python examples/geo3k_vlm/data/make_sample.py                 # defaults used for the committed files
    python examples/geo3k_vlm/data/make_sample.py --source DIR --num-train 64 --num-test 16 --seed 0

Running it again with the same source, sizes and seed gives the same rows.  It exits with an
error if the written files together exceed ``--max-bytes`` (the repository keeps the sample
small).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))


def pick_rows(num_rows: int, size: int, seed: int) -> list[int]:
    """Sorted row indices of a seeded random subset of ``size`` rows out of ``num_rows``.

    Raises:
        ValueError: ``size`` is larger than ``num_rows``.
    """
    if size > num_rows:
        raise ValueError(f"cannot pick {size} rows from a file with {num_rows} rows; lower the sample size")
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(num_rows, size=size, replace=False))


def write_split(source: str, dest: str, size: int, seed: int) -> int:
    """Copy a seeded subset of the parquet ``source`` to ``dest``; returns the bytes written.

    The schema, including its ``huggingface`` feature metadata, is carried over unchanged.
    """
    table = pq.read_table(source)
    if b"huggingface" not in (table.schema.metadata or {}):
        raise ValueError(f"{source} has no Hugging Face feature metadata; `datasets` would not decode its images")
    subset = table.take(pick_rows(table.num_rows, size, seed))
    pq.write_table(subset, dest, compression="zstd")
    return os.path.getsize(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="/work/shared/data/geo3k", help="folder with train.parquet and test.parquet")
    parser.add_argument("--dest", default=HERE, help="output folder (default: this script's folder)")
    parser.add_argument("--num-train", type=int, default=64, help="rows to keep from train.parquet")
    parser.add_argument("--num-test", type=int, default=16, help="rows to keep from test.parquet")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row pick")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="fail if the two files exceed this size")
    args = parser.parse_args(argv)

    total = 0
    for split, size in (("train", args.num_train), ("test", args.num_test)):
        source = os.path.join(args.source, f"{split}.parquet")
        if not os.path.isfile(source):
            parser.error(f"--source {args.source}: {split}.parquet not found")
        written = write_split(source, os.path.join(args.dest, f"{split}.parquet"), size, args.seed)
        print(f"{split}: {size} rows, {written} bytes")
        total += written
    if total > args.max_bytes:
        print(f"the sample is {total} bytes, over --max-bytes {args.max_bytes}; use fewer rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packing whole groups of tensors into buckets of about a byte budget: one rule for every bucketing.

Groups are taken in order and never split; a bucket closes as soon as it holds at least ``bucket_bytes``
bytes (so a group larger than the budget is a bucket of its own).  Used for the weight-sync rounds of
both backends and the safetensors shards of saved Hugging Face folders.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

from torch import Tensor

T = TypeVar("T")


def pack_by_bytes(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int) -> Iterator[list[T]]:
    """Consecutive ``items`` packed by the rule as they stream in (``nbytes``: a group's size, bytes).

    Raises:
        ValueError: ``bucket_bytes <= 0`` (on the first ``next``).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[T] = []
    size = 0
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def bucket_by_bytes(
    groups: Iterable[list[tuple[str, Tensor]]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Groups of ``(name, tensor)`` (e.g. one layer each) concatenated into buckets by the rule, order kept.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    def nbytes(group: list[tuple[str, Tensor]]) -> int:
        return sum(t.numel() * t.element_size() for _, t in group)

    for packed in pack_by_bytes(groups, nbytes, bucket_bytes):
        yield [named for group in packed for named in group]


def weight_rounds(group_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The rule over group sizes alone (bytes): each round's group indices, so every rank computes the same rounds.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    return list(pack_by_bytes(range(len(group_bytes)), group_bytes.__getitem__, bucket_bytes))

"""Weight-sync flags (BACKEND_ARGS (weight sync)), upstream slime's names."""

from __future__ import annotations

import dataclasses

from slime.utils.config import check_at_least_one, flag

DEFAULT_BUCKET_BYTES = 512 << 20
"""Bucket size when ``--update-weight-buffer-size`` is not given: 512 MiB (upstream slime's default)."""


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """Weight sync to the engines (BACKEND_ARGS): bucket size. The transport follows from the engine and placement."""

    update_weight_buffer_size: int | None = flag(
        None,
        help="Bytes per weight-sync bucket: each trainer rank sends its weights to the engines in buckets of about "
        "this size (whole layers; a layer larger than this is a bucket of its own). Default: 512 MiB (536870912 "
        "bytes, upstream slime's). Into colocated SGLang engines (CUDA IPC) larger buckets are faster, at the cost of "
        "free GPU memory during the sync (up to two buckets alive): a 9.66 GB model synced at 27.0 GB/s in 512 MiB "
        "buckets and 33.1 GB/s in 4 GiB ones on one H200 (docs/results/h200_sglang.md, run 6). Through Ray's "
        "object store (the transformers engine, every CPU run) a bucket is "
        "at most half the smallest node's store divided by the trainer ranks, since every rank may hold one there "
        "at once: a larger value is lowered to that, with a warning.",
    )

    def __post_init__(self):
        check_at_least_one(self, "update_weight_buffer_size")

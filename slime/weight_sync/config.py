"""Weight-sync flags (BACKEND_ARGS (weight sync)), upstream slime's names."""

from __future__ import annotations

import dataclasses

from slime.utils.config import check_at_least_one, flag


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """Weight sync to the engines (BACKEND_ARGS): bucket size. The transport follows from the engine and placement."""

    update_weight_buffer_size: int = flag(
        512 << 20,
        help="Bytes per weight-sync bucket: each trainer rank sends its weights to the engines in buckets of about "
        "this size (whole layers; a layer larger than this is a bucket of its own).",
    )

    def __post_init__(self):
        check_at_least_one(self, "update_weight_buffer_size")

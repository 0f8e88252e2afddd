"""Weight sync through Ray's object store: the transformers engine's path, and any engine's on CPU.

Each rank ``ray.put``s each of its non-empty buckets (CPU tensors) once, hands it to every engine's
``update_weights_from_tensor`` and waits before the next, so at most one bucket per rank sits in a
store; :meth:`ObjectStoreTransport.connect` lowers the bucket to fit (:func:`bucket_limit`).  Buckets of
several ranks reach an engine in any order.  Why: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Sequence

import ray

from slime.weight_sync.base import TrainerRanks, WeightBucket, WeightTransport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from slime.backends.config import RankInfo
    from slime.ray.engine_group import RolloutEngineGroup

logger = logging.getLogger(__name__)

STORE_SHARE_FOR_WEIGHTS = 0.5
"""Fraction of a node's object store that the weight buckets of all trainer ranks may fill at once."""


def bucket_limit(store_bytes: int, num_ranks: int) -> int:
    """The largest bucket the store holds from every rank at once, bytes (>= 1).

    ``floor(STORE_SHARE_FOR_WEIGHTS * store_bytes / num_ranks)``, ``store_bytes`` the smallest node's store.

    Raises:
        ValueError: ``num_ranks < 1`` or ``store_bytes < 1``.
    """
    if num_ranks < 1 or store_bytes < 1:
        raise ValueError(f"need >= 1 trainer rank and a non-empty object store, got {num_ranks} and {store_bytes} bytes")
    return max(1, int(STORE_SHARE_FOR_WEIGHTS * store_bytes) // num_ranks)


def object_store_bytes() -> int:
    """The object store of the smallest alive node of the connected Ray cluster, bytes.

    Raises:
        RuntimeError: Ray reports no alive node with an object store.
    """
    sizes = [node["Resources"].get("object_store_memory", 0) for node in ray.nodes() if node.get("Alive")]
    sizes = [int(size) for size in sizes if size > 0]
    if not sizes:
        raise RuntimeError("Ray reports no alive node with an object store")
    return min(sizes)


def _mib(size: int) -> str:
    return f"{size / 2**20:.4g} MiB"


class ObjectStoreTransport(WeightTransport):
    """CPU buckets via ``ray.put`` into every engine's ``update_weights_from_tensor``; caches flushed at the end."""

    name = "object_store"
    tensor_device = "cpu"

    def connect(self, trainers: TrainerRanks, engines: RolloutEngineGroup) -> None:
        """Fit the bucket to the object store (:meth:`fit_bucket`), then hand this transport to the ranks."""
        self.fit_bucket(object_store_bytes(), len(trainers.actors))
        super().connect(trainers, engines)

    def fit_bucket(self, store_bytes: int, num_ranks: int) -> int:
        """Lower :attr:`bucket_bytes` to :func:`bucket_limit` if larger (a warning if the user set it); returns it."""
        limit = bucket_limit(store_bytes, num_ranks)
        if self.bucket_bytes > limit:
            log = logger.warning if self.bucket_bytes_given else logger.info
            log(
                "--update-weight-buffer-size %d (%s) does not fit Ray's object store of %s: %d trainer ranks may each "
                "hold one bucket there at once and half of it is kept for rollout data; using %d (%s) per bucket",
                self.bucket_bytes, _mib(self.bucket_bytes), _mib(store_bytes), num_ranks, limit, _mib(limit),
            )
            self.bucket_bytes = limit
        return self.bucket_bytes

    def send(self, buckets: Iterable[WeightBucket], rank: RankInfo, engines: Sequence[ActorHandle]) -> list[str]:
        """Push this rank's non-empty buckets to every engine, one bucket at a time.

        Raises:
            KeyError / ValueError: from an engine, for a name or shape it does not have.
        """
        sent: list[str] = []
        for bucket in buckets:
            if not bucket:
                continue
            ref = ray.put(bucket)
            ray.get([engine.update_weights_from_tensor.remote(ref, False) for engine in engines])
            del ref
            sent += [name for name, _ in bucket]
        return sent

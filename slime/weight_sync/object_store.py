"""Weight sync through Ray's object store: the transformers engine's path, and any engine's on CPU.

Each trainer rank ``ray.put``s every non-empty bucket of its own (CPU tensors) once and hands
the reference to every engine's ``update_weights_from_tensor``; it waits for all engines before
the next bucket, so at most one bucket per sending rank sits in the store (the local store is
capped at 1 GiB, :func:`slime.ray.placement.init_ray`; ``--update-weight-buffer-size`` must stay
well below it).  Engines are Ray actors that run one call at a time, so buckets from several
ranks arrive one after another in any order; an engine must accept that (the transformers engine
does: it fuses a parameter once all of its checkpoint tensors have arrived).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import ray

from slime.weight_sync.base import WeightBucket, WeightTransport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from slime.backends.base import RankInfo


class ObjectStoreTransport(WeightTransport):
    """CPU buckets via ``ray.put`` into every engine's ``update_weights_from_tensor``; caches flushed at the end."""

    name = "object_store"
    tensor_device = "cpu"

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

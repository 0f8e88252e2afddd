"""Weight sync by NCCL broadcast into disaggregated engines (SGLang ``/init_weights_update_group`` +
``/update_weights_from_distributed``).

Trainer rank ``r`` owns the group ``slime-weights-r<r>``: itself as rank 0, then every engine GPU (engine
``e``'s TP rank ``i`` at ``1 + offset(e) + i``).  Each non-empty bucket, split by dtype, is broadcast from
rank 0 while the engines receive it.  NCCL needs the engines on other GPUs than the trainers;
``backend="gloo"`` runs the same protocol on CPU tensors (tests).  Step by step: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Iterable, Sequence

import ray
import torch

from slime.weight_sync.base import TrainerRanks, WeightBucket, WeightTransport
from slime.weight_sync.flattened import dtype_name, flatten

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from slime.backends.config import RankInfo
    from slime.ray.engine_group import RolloutEngineGroup

GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def group_name(rank: int) -> str:
    return f"slime-weights-r{rank}"


def rank_offsets(tp_sizes: Sequence[int]) -> list[int]:
    """Group rank of each engine's TP rank 0: ``1 + the GPUs of the engines before it``."""
    offsets, total = [], 1
    for tp in tp_sizes:
        offsets.append(total)
        total += tp
    return offsets


def split_by_dtype(bucket: WeightBucket) -> list[WeightBucket]:
    """``bucket`` cut into runs of one dtype, in order (a flattened NCCL buffer holds one dtype)."""
    runs: list[WeightBucket] = []
    for name, tensor in bucket:
        if runs and runs[-1][0][1].dtype == tensor.dtype:
            runs[-1].append((name, tensor))
        else:
            runs.append([(name, tensor)])
    return runs


def init_weight_group(master_address: str, master_port: int, world_size: int, rank: int, name: str,
                      backend: str = "nccl"):
    """A process group outside the trainers' world (broadcast ``src=0``), rendezvous at ``master_address:master_port``.

    Rank 0 hosts the store, as SGLang's ``init_custom_process_group`` expects.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=GROUP_TIMEOUT))
    store.set_timeout(GROUP_TIMEOUT)
    pg, _ = _new_process_group_helper(world_size, rank, [], torch.distributed.Backend(backend),
                                      PrefixStore(name, store), group_name=name, backend_options=None,
                                      timeout=GROUP_TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _address(actor) -> tuple[str, int]:
    """Run in a trainer actor (``__ray_call__``): its node's address and a free port there."""
    from slime.ray.placement import free_port, node_ip

    return node_ip(), free_port()


class NcclTransport(WeightTransport):
    """NCCL transport (see the module docstring); ``backend``: ``"nccl"`` or ``"gloo"``."""

    name = "nccl"
    tensor_device = None

    def __init__(self, bucket_bytes: int | None = None, num_experts: int | None = None, backend: str = "nccl"):
        super().__init__(bucket_bytes, num_experts)  # the broadcast sends experts as the checkpoint names them
        self.backend = backend
        self.addresses: list[tuple[str, int]] = []
        self.world_size = 0
        self._group = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_group"] = None
        return state

    def connect(self, trainers: TrainerRanks, engines: RolloutEngineGroup) -> None:
        """Form one group per trainer rank with every engine GPU.

        Raises:
            ray.exceptions.RayTaskError: an engine or a rank failed to join (SGLang's message inside).
        """
        if self.addresses:  # a reconnect: engines leave the old groups first (a new actor has none)
            ray.get([a.destroy_weights_update_group.remote(group_name(r))
                     for a in engines.actors for r in range(len(self.addresses))])
        tp_sizes = [len(r.local_gpu_ids) or 1 for r in engines.resources]
        offsets = rank_offsets(tp_sizes)
        self.world_size = 1 + sum(tp_sizes)
        self.addresses = ray.get([a.__ray_call__.remote(_address) for a in trainers.actors])
        joins = [
            actor.init_weights_update_group.remote(address, port, offsets[e], self.world_size, group_name(r))
            for r, (address, port) in enumerate(self.addresses)
            for e, actor in enumerate(engines.actors)
        ]
        ray.get(trainers.connect_ranks(self, engines) + joins)

    def connect_rank(self, rank: RankInfo, engines: Sequence[ActorHandle]) -> None:
        import torch.distributed as dist

        if self._group is not None:  # a reconnect: the old group's engine ranks are gone
            dist.destroy_process_group(self._group)
        address, port = self.addresses[rank.rank]
        self._group = init_weight_group(address, port, self.world_size, 0, group_name(rank.rank), self.backend)

    def begin_sync(self, engines: RolloutEngineGroup) -> None:
        engines.pause_generation()
        engines.flush_cache()

    def send(self, buckets: Iterable[WeightBucket], rank: RankInfo, engines: Sequence[ActorHandle]) -> list[str]:
        """Broadcast this rank's buckets to every engine (no collectives between trainer ranks).

        Raises:
            ray.exceptions.RayTaskError: an engine refused a bucket (SGLang's message inside).
        """
        import torch.distributed as dist

        sent: list[str] = []
        name = group_name(rank.rank)
        for bucket in buckets:
            for run in split_by_dtype(bucket):
                names = [n for n, _ in run]
                calls = [engine.update_weights_from_distributed.remote(
                    names, [dtype_name(t.dtype) for _, t in run], [list(t.shape) for _, t in run], name)
                    for engine in engines]  # fmt: skip
                flat = flatten(run, align=1)
                options = dist.BroadcastOptions()
                options.rootRank = 0
                self._group.broadcast([flat.buffer], options).wait()
                ray.get(calls)
                del flat
                sent += names
        return sent

    def end_sync(self, engines: RolloutEngineGroup) -> None:
        engines.weights_updated()
        engines.continue_generation()

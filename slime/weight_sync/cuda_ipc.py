"""Weight sync by CUDA IPC into colocated engines (SGLang ``/update_weights_from_tensor``, ``flattened_bucket``).

One trainer rank and one engine TP rank per GPU, so the weights never leave the GPUs: per round the
source rank flattens its bucket into a new buffer (MoE layers as fused tensors) and broadcasts it to
every trainer GPU; each rank hands a CUDA IPC handle of its copy to the engine TP rank on its GPU.  At
most two buffers per rank are alive (twice ``--update-weight-buffer-size``); bytes moved per sync: the
model once per GPU.  The protocol step by step and why: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Sequence

import ray
import torch

from slime.weight_sync.base import TrainerRanks, WeightBucket, WeightTransport
from slime.weight_sync.flattened import FlatBucket, flatten, serialize_ipc_bucket
from slime.weight_sync.fused_experts import fused_layout

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from slime.backends.config import RankInfo
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.rollout.engines.base import EngineResources


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """Which engine and TP rank run on one trainer rank's GPU."""

    engine: int
    tp_rank: int


def locate(node_id: str, gpu_id: str, engines: Sequence[EngineResources]) -> EngineSlot | None:
    """The engine TP rank on GPU ``gpu_id`` of node ``node_id`` (Ray's ids), or None if no engine uses it."""
    for resources in engines:
        local = [(b.node_id, gpu) for b in resources.bundles if b.node_id == resources.bundles[0].node_id
                 for gpu in b.gpu_ids]
        if (node_id, str(gpu_id)) in local:
            return EngineSlot(resources.index, local.index((node_id, str(gpu_id))))
    return None


def ipc_plan(slots: Sequence[EngineSlot | None], engines: Sequence[EngineResources]) -> dict[int, list[int]]:
    """For each engine, the trainer ranks on its GPUs in TP order, from every rank's :func:`locate`.

    Raises:
        ValueError: an engine TP rank with no trainer rank or with two on its GPU (the message names them).
    """
    plan: dict[int, dict[int, int]] = {r.index: {} for r in engines}
    for rank, slot in enumerate(slots):
        if slot is None:
            continue
        if slot.tp_rank in plan[slot.engine]:
            raise ValueError(f"trainer ranks {plan[slot.engine][slot.tp_rank]} and {rank} share the GPU of engine "
                             f"{slot.engine} TP rank {slot.tp_rank}; CUDA IPC needs one trainer rank per GPU")
        plan[slot.engine][slot.tp_rank] = rank
    out = {}
    for resources in engines:
        tp = len(resources.local_gpu_ids)
        missing = [i for i in range(tp) if i not in plan[resources.index]]
        if missing:
            raise ValueError(
                f"no trainer rank shares the GPU of {resources.describe()} TP rank(s) {missing}: CUDA IPC weight sync "
                "needs every engine GPU colocated with a trainer rank (--colocate with as many rollout GPUs as "
                "trainer GPUs)"
            )
        out[resources.index] = [plan[resources.index][i] for i in range(tp)]
    return out


class CudaIpcTransport(WeightTransport):
    """CUDA IPC transport (see the module docstring)."""

    name = "cuda_ipc"
    tensor_device = None

    def __init__(self, bucket_bytes: int | None = None, num_experts: int | None = None):
        super().__init__(bucket_bytes, num_experts)
        self.engine_resources: list[EngineResources] = []
        self._group = None
        self._plan: dict[int, list[int]] = {}

    def __getstate__(self):  # a process group does not travel
        state = dict(self.__dict__)
        state["_group"] = None
        return state

    def connect(self, trainers: TrainerRanks, engines: RolloutEngineGroup) -> None:
        self.engine_resources = list(engines.resources)
        ray.get(trainers.connect_ranks(self, engines))

    def connect_rank(self, rank: RankInfo, engines: Sequence[ActorHandle]) -> None:
        """Find this rank's engine TP rank and build the plan (collective over the trainer ranks).

        Raises:
            ValueError: see :func:`ipc_plan`.
        """
        import torch.distributed as dist

        if self._group is not None:
            dist.destroy_process_group(self._group)
        self._group = dist.new_group(backend="gloo")
        gpu_ids = ray.get_gpu_ids()
        node = ray.get_runtime_context().get_node_id()
        slot = locate(node, str(gpu_ids[0]), self.engine_resources) if gpu_ids else None
        slots: list = [None] * rank.world_size
        dist.all_gather_object(slots, slot, group=self._group)
        self._plan = ipc_plan(slots, self.engine_resources)

    def begin_sync(self, engines: RolloutEngineGroup) -> None:
        engines.pause_generation()
        engines.flush_cache()

    def send(self, buckets: Iterable[WeightBucket], rank: RankInfo, engines: Sequence[ActorHandle]) -> list[str]:
        """Move this rank's buckets into every engine (collective over the trainer ranks).

        Raises:
            RuntimeError: an engine refused a bucket (its message).
        """
        import torch.distributed as dist

        sent: list[str] = []
        device = torch.device("cuda", torch.cuda.current_device())
        leads = {ranks[0]: engine for engine, ranks in self._plan.items()}
        loading: tuple[ray.ObjectRef | None, torch.Tensor] | None = None  # the engines' load, and its buffer

        def wait_loaded() -> None:  # every engine has loaded the previous buffer, every rank is past it
            nonlocal loading
            if loading is not None:
                if loading[0] is not None:
                    ray.get(loading[0])
                dist.barrier(group=self._group)
                loading = None

        for bucket in buckets:
            ordered, meta = bucket, None
            if bucket:
                ordered, metadata, total = fused_layout(bucket, self.num_experts)
                meta = (metadata, total)
            metas: list = [None] * rank.world_size
            dist.all_gather_object(metas, meta, group=self._group)
            for source, source_meta in enumerate(metas):
                if source_meta is None:
                    continue
                metadata, total = source_meta
                # made while the engines still load the previous buffer: the two overlap
                if source == rank.rank:
                    buffer = flatten(ordered, device=device).buffer
                else:
                    buffer = torch.empty(total, dtype=torch.uint8, device=device)
                if rank.world_size > 1:
                    dist.broadcast(buffer, src=source)
                torch.cuda.current_stream().synchronize()
                handle = serialize_ipc_bucket(FlatBucket(buffer, metadata))
                handles: list = [None] * rank.world_size
                dist.all_gather_object(handles, handle, group=self._group)
                wait_loaded()  # one update at a time, in order; the previous buffer is freed here
                ref = None
                if rank.rank in leads:
                    engine = leads[rank.rank]
                    ref = engines[engine].update_weights_from_ipc.remote([handles[r] for r in self._plan[engine]])
                loading = (ref, buffer)
                del buffer
            if bucket:
                sent += [name for name, _ in bucket]
        wait_loaded()
        return sent

    def end_sync(self, engines: RolloutEngineGroup) -> None:
        engines.weights_updated()
        engines.continue_generation()

"""An engine that only receives weights over the NCCL transport's protocol (run with ``backend="gloo"`` on CPU),
for :mod:`tests.test_weight_transports_sglang`.

:class:`ReceiverEngine` joins each trainer rank's group as SGLang's server does
(``init_weights_update_group``: rank ``rank_offset + tp_rank`` of ``world_size``, rendezvous at the trainer's
store), and on ``update_weights_from_distributed`` rebuilds the bucket the way SGLang 0.5.17's
``_update_bucketed_weights_from_distributed`` does: empty tensors of the announced names, dtypes and shapes,
flattened back to back, one broadcast from rank 0, split again.  ``received()`` gives what arrived.
"""

from __future__ import annotations

import torch

from slime.rollout.engines.base import EngineResources, GenerateOutput, RolloutEngine
from slime.weight_sync.nccl import init_weight_group


class ReceiverEngine(RolloutEngine):
    weight_transports = ("nccl", "object_store")

    def __init__(self, resources: EngineResources):
        self.resources = resources
        self.groups: dict = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, str]] = []

    @classmethod
    def from_spec(cls, spec, resources: EngineResources) -> ReceiverEngine:
        return cls(resources)

    def generate(self, requests):
        return [GenerateOutput("", [], [], "stop", 0) for _ in requests]

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        raise AssertionError("this engine takes weights over the NCCL protocol only")

    def release_memory_occupation(self, tags=None) -> None:
        pass

    def resume_memory_occupation(self, tags=None) -> None:
        pass

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name) -> None:
        self.calls.append(("init", group_name))
        self.groups[group_name] = init_weight_group(master_address, master_port, world_size, rank_offset, group_name,
                                                    backend="gloo")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name) -> None:
        self.calls.append(("update", group_name))
        empties = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in empties])
        torch.distributed.broadcast(flat, src=0, group=self.groups[group_name])
        offset = 0
        for name, t in zip(names, empties):
            size = t.numel() * t.element_size()
            self.tensors[name] = flat[offset : offset + size].view(t.dtype).reshape(t.shape).clone()
            offset += size

    def destroy_weights_update_group(self, group_name) -> None:
        group = self.groups.pop(group_name, None)
        if group is not None:
            torch.distributed.destroy_process_group(group)

    def received(self) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
        return self.tensors, self.calls

"""Process groups of the Megatron backend: the trainer world, then megatron-core's parallel state.

The world is one default group (``"cpu:gloo,cuda:nccl"`` on GPUs, gloo on CPU); megatron-core's
``initialize_model_parallel`` cuts it into TP, PP, CP, EP, expert-TP and data-parallel groups (rank order
``tp-cp-ep-dp-pp``) with gloo twins of the data-parallel groups.  The backend itself uses ``dp_gloo`` (loss
normalisers, micro-batch counts), ``tp`` (vocab-parallel log-probs) and the world (metrics: the backend's
:class:`~slime.backends.train_metrics.DataParallel` sums over it and divides by TP).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

from slime.backends.config import RankInfo
from slime.backends.megatron.config import MegatronConfig

logger = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(minutes=30)
"""Collective timeout of the trainer groups (megatron-core's default ``distributed_timeout_minutes``)."""


def init_world(rank_info: RankInfo) -> torch.device:
    """Join (or reuse) the trainer world's default process group; returns this rank's device.

    Raises:
        RuntimeError: a process group of another size or rank is already initialised.
    """
    device = torch.device("cpu")
    if rank_info.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank_info.rank % torch.cuda.device_count()))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank_info.rank, rank_info.world_size):
            raise RuntimeError(
                f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists, "
                f"but this backend is rank {rank_info.rank} of {rank_info.world_size}"
            )
        return device
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{rank_info.master_addr}:{rank_info.master_port}",
        rank=rank_info.rank,
        world_size=rank_info.world_size,
        timeout=TIMEOUT,
    )
    return device


def init_model_parallel(cfg: MegatronConfig, device: torch.device, seed: int) -> None:
    """megatron-core's parallel state for ``cfg``'s sizes (kept when already set with the same sizes, else
    ``RuntimeError``), and on CUDA its model-parallel RNG (``model_parallel_cuda_manual_seed``, as Megatron-LM seeds).
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        want = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.expert_model_parallel_size)
        if have != want:
            raise RuntimeError(f"megatron-core's parallel state is initialised with (TP, PP, EP) {have}, not {want}")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel,
        distributed_timeout_minutes=int(TIMEOUT.total_seconds() // 60),
    )
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's coordinates and the groups the backend itself communicates over (module docstring)."""

    tp: dist.ProcessGroup
    tp_size: int
    dp_gloo: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int

    @classmethod
    def current(cls) -> "Groups":
        """From megatron-core's initialised parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            dp_gloo=ps.get_data_parallel_group_gloo(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
        )

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the LM head (and computes the loss)."""
        return self.pp_rank == self.pp_size - 1

"""Weight sync from the trainer ranks to the rollout engines: one transport per run (see :mod:`.base`).

:func:`make_transport` picks it from what the engine class accepts and where the engines sit: on GPUs a
colocated engine prefers CUDA IPC and a disaggregated one an NCCL broadcast; on CPU only the object
store moves tensors.  Transports are registered lazily (importing this package imports none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from slime.utils.config import ConfigError
from slime.utils.registry import Builtin, Registry
from slime.weight_sync.config import WeightSyncConfig

if TYPE_CHECKING:  # this package's __init__ runs before its light config.py: it imports no torch
    from slime.weight_sync.base import WeightTransport

WEIGHT_TRANSPORTS: Registry[type[WeightTransport]] = Registry(
    "weight-sync transport",
    "RolloutEngine.weight_transports",
    builtins={
        "object_store": Builtin(target="slime.weight_sync.object_store:ObjectStoreTransport"),
        "cuda_ipc": Builtin(target="slime.weight_sync.cuda_ipc:CudaIpcTransport"),
        "nccl": Builtin(target="slime.weight_sync.nccl:NcclTransport"),
    },
)
"""Transport classes by name: the object store (every engine), CUDA IPC and NCCL (the SGLang engine; see
:mod:`.base`)."""

OBJECT_STORE = "object_store"
CUDA_IPC = "cuda_ipc"
NCCL = "nccl"

PREFERENCE = {
    (True, True): (CUDA_IPC, OBJECT_STORE),  # GPU, colocated: the weights never leave the GPU
    (True, False): (NCCL, OBJECT_STORE),  # GPU, disaggregated: a broadcast over the network
    (False, True): (OBJECT_STORE,),  # CPU
    (False, False): (OBJECT_STORE,),
}
"""``(use_gpu, colocate)`` -> transports to try, best first."""


def choose_transport(supported: Sequence[str], *, use_gpu: bool, colocate: bool) -> str:
    """The run's transport: the first of :data:`PREFERENCE` for this placement that the engine class supports.

    Raises:
        ConfigError: the engine supports none of them (the message lists both sides).
    """
    wanted = PREFERENCE[(use_gpu, colocate)]
    for name in wanted:
        if name in supported:
            return name
    where = ("colocated" if colocate else "disaggregated") + (" GPU" if use_gpu else " CPU")
    raise ConfigError(
        f"the rollout engine takes weights by {', '.join(supported) or 'no transport'}, but a {where} run needs "
        f"one of {', '.join(wanted)}"
    )


def make_transport(
    supported: Sequence[str], cfg: WeightSyncConfig, *, use_gpu: bool, colocate: bool, num_experts: int | None = None
) -> WeightTransport:
    """Build the run's transport with ``--update-weight-buffer-size`` and the routed experts per layer.

    Raises:
        ConfigError: see :func:`choose_transport`.
        slime.utils.registry.Unavailable / ImportError: the chosen transport is not in this version.
    """
    name = choose_transport(supported, use_gpu=use_gpu, colocate=colocate)
    return WEIGHT_TRANSPORTS.get(name)(bucket_bytes=cfg.update_weight_buffer_size, num_experts=num_experts)


__all__ = [
    "WEIGHT_TRANSPORTS",
    "WeightSyncConfig",
    "choose_transport",
    "make_transport",
]

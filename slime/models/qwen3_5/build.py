"""The native model outside a trainer (tools, benchmarks, parity checks): one-process megatron-core state,
and a native model made from an in-memory transformers model.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from slime.models.qwen3_5.config import ParallelLayout, Qwen35Kernels, qwen35_config_from_hf


def initialize_single_process(device: str = "cuda", seed: int = 0) -> None:
    """A one-process ``torch.distributed`` group (NCCL on CUDA, gloo on CPU), megatron-core at TP = PP = EP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        if device == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)


def transformers_qwen35_without_fla():
    """transformers' Qwen3.5-MoE modeling module imported with ``fla`` hidden, so its GDN takes the torch path.

    Raises:
        RuntimeError: the module was already imported with fla importable.
    """
    name = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
    if name in sys.modules:
        if importlib.util.find_spec("fla") is not None:
            raise RuntimeError(f"{name} was imported before this call, with fla importable; call this first")
        return sys.modules[name]
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def native_from_hf_model(hf_model, *, kernels: Qwen35Kernels, dtype: torch.dtype | None = None,
                         layout: ParallelLayout = ParallelLayout(), **overrides):
    """A ``Qwen35Model`` holding exactly the weights of an in-memory ``Qwen3_5MoeForConditionalGeneration``.

    Loaded through the checkpoint rules, on the HF model's device; ``dtype`` defaults to the HF model's,
    ``overrides`` are further ``TransformerConfig`` fields; megatron-core must be initialised for ``layout``.
    """
    from slime.models.qwen3_5.model import Qwen35Model
    from slime.models.qwen3_5.weights import StateDictReader, load_hf_checkpoint

    dtype = dtype or next(hf_model.parameters()).dtype
    device = next(hf_model.parameters()).device
    # megatron-core allocates with the ambient device (meta here) only with use_cpu_initialization.
    overrides.setdefault("use_cpu_initialization", True)
    overrides.setdefault("perform_initialization", False)
    if device.type != "cuda":
        overrides.setdefault("moe_token_dispatcher_type", "allgather")
    config = qwen35_config_from_hf(hf_model.config.to_dict(), layout, params_dtype=dtype, kernels=kernels, **overrides)
    with torch.device("meta"):
        model = Qwen35Model(config)
    state = {n: p.detach() for n, p in hf_model.named_parameters()}
    load_hf_checkpoint(model, StateDictReader(state))
    return model

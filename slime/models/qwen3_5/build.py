"""Building the native model outside a trainer: one-process megatron-core state, and a native model made
from an in-memory transformers model (same weights), for tools, benchmarks and parity checks.

The trainer backend initialises megatron-core itself and builds ``Qwen35Model`` per pipeline stage
(``slime.models.qwen3_5.model``) and loads it with :func:`slime.models.qwen3_5.weights.load_hf_checkpoint`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from slime.models.qwen3_5.config import ParallelLayout, Qwen35Kernels, qwen35_config_from_hf


def initialize_single_process(device: str = "cuda", seed: int = 0) -> None:
    """A one-process ``torch.distributed`` group (NCCL on CUDA, gloo on CPU) with megatron-core's
    parallel state at TP = PP = EP = 1.  Idempotent."""
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
    """transformers' Qwen3.5-MoE modeling module with its Gated DeltaNet on the torch reference path.

    transformers binds fla's kernels at import time when fla is importable; importing the module
    while ``fla`` is hidden gives the reference (torch chunked) path, the configuration of the
    baseline figures (grouped-GEMM experts, SDPA, no fla).  Must run before anything imports that
    module; raises ``RuntimeError`` otherwise.
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

    Built on the meta device, then materialised on the HF model's device and filled through the
    same rules as a checkpoint load (experts read from the fused in-memory tensors).

    Args:
        hf_model: the transformers model (any device).
        kernels: the native model's kernels.
        dtype: parameter dtype (default: the HF model's).
        layout: parallel layout (megatron-core must be initialised accordingly).
        **overrides: further ``TransformerConfig`` fields.
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

"""This rank's pipeline stage of the native Qwen3.5 model, allocated uninitialised on the training device and filled
from a Hugging Face folder with :func:`slime.models.qwen3_5.weights.load_hf_checkpoint` (only this rank's TP / EP /
ETP slices are read).  Shaped by :class:`slime.backends.megatron.config.MegatronConfig` (parallel sizes, recompute,
dropout) and ``--attention-backend`` (:func:`kernels_for`).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from slime.backends.megatron.config import MegatronConfig
from slime.errors import SlimeError
from slime.models.qwen3_5.config import Qwen35Kernels, qwen35_config_from_hf

logger = logging.getLogger(__name__)

GPU_KERNEL_PACKAGES = ("flash-linear-attention==0.6.0", "fla-core==0.6.0", "tilelang==0.1.15")
"""What the bf16 GPU kernels of the Gated DeltaNet need beyond megatron-core (the rest of the ``megatron``
extra of pyproject.toml); the CPU / fp32 torch paths need none of them."""


class KernelUnavailable(SlimeError, RuntimeError):
    """The selected kernels cannot run here (package missing, or a kernel that needs CUDA and bf16)."""


def kernels_for(megatron: MegatronConfig, dtype: torch.dtype, device: torch.device) -> Qwen35Kernels:
    """The model's kernels for ``--attention-backend``: ``auto`` the fast ones where they are right
    (:meth:`slime.models.qwen3_5.config.Qwen35Kernels.for_dtype`: fla + ``varlen_attn`` for bf16 on CUDA, the torch
    paths otherwise), ``flash`` torch's varlen FlashAttention-2, ``local`` / ``unfused`` SDPA per document.

    Raises:
        KernelUnavailable: ``flash`` off CUDA / in fp32, or fla not installed where its kernels are picked.
    """
    auto = Qwen35Kernels.for_dtype(dtype, device.type)
    backend = megatron.attention_backend
    if backend in ("local", "unfused"):
        kernels = Qwen35Kernels(gdn=auto.gdn, attention="sdpa")
    elif backend == "flash":
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            raise KernelUnavailable(
                f"--attention-backend flash runs torch's varlen FlashAttention, which needs CUDA and bf16 "
                f"(here: {device.type}, {dtype}); add --bf16 on a GPU, or use --attention-backend auto"
            )
        kernels = Qwen35Kernels(gdn=auto.gdn, attention="varlen")
    else:
        kernels = auto
    if kernels.gdn == "fla" and importlib.util.find_spec("fla") is None:
        raise KernelUnavailable(
            f"the Gated DeltaNet's bf16 GPU kernels need {', '.join(GPU_KERNEL_PACKAGES)} (fla is not importable); "
            "install the megatron extra (scripts/setup_env.sh on a GPU node does)"
        )
    return kernels


def build_stage(
    hf_folder: str | Path, megatron: MegatronConfig, *, dtype: torch.dtype, device: torch.device,
    load: bool = True,
):
    """This rank's stage of the model, its weights read from ``hf_folder`` unless ``load`` is False (a checkpoint fills
    them); ``dtype``: the parameters' (``A_log`` stays fp32); ``device``: megatron-core's parallel state must be set.

    Raises:
        slime.models.qwen3_5.config.Qwen35ConfigError: the checkpoint or layout is not buildable.
        slime.models.qwen3_5.weights.WeightMappingError: a tensor is missing or misshaped.
        KernelUnavailable: see :func:`kernels_for`.
        slime.utils.config.ConfigError: ``--moe-token-dispatcher-type alltoall`` on CPU
            (:meth:`MegatronConfig.token_dispatcher`).
    """
    from megatron.core import parallel_state as ps

    from slime.models.qwen3_5.model import Qwen35Model
    from slime.models.qwen3_5.weights import load_hf_checkpoint

    overrides = dict(
        recompute_granularity=megatron.recompute_granularity,
        recompute_method=megatron.recompute_method,
        recompute_num_layers=megatron.recompute_num_layers,
        hidden_dropout=megatron.hidden_dropout,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=False,
        moe_token_dispatcher_type=megatron.token_dispatcher(cuda=device.type == "cuda"),
    )
    config = qwen35_config_from_hf(hf_folder, megatron.layout(), params_dtype=dtype,
                                   kernels=kernels_for(megatron, dtype, device), **overrides)
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    model = Qwen35Model(config, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1)
    if load:
        report = load_hf_checkpoint(model, hf_folder)
        logger.info("loaded %d tensors of %s (skipped: %s)", report.loaded, hf_folder, report.skipped or "none")
    wrong = [n for n, p in model.named_parameters() if getattr(p, "keep_fp32", False) and p.dtype != torch.float32]
    if wrong:
        raise RuntimeError(f"parameters marked keep_fp32 are not fp32: {wrong[:3]}")
    return model

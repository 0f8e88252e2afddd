"""The two RMSNorms of Qwen3.5, in transformers' numerics (``rms`` over the last dimension, in fp32).

Both take megatron-core's norm constructor signature ``(config, hidden_size, eps)``, so that a
``ModuleSpec`` can place them; ``config`` ``None`` gives fp32 weights on the default device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def param_device(config) -> torch.device | None:
    """Where megatron-core would allocate a parameter: the current GPU; ``None`` (ambient device) under
    ``use_cpu_initialization`` or without CUDA.
    """
    if config is None or getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * (1 + weight)``, zero-centred weight (transformers ``Qwen3_5MoeRMSNorm``).

    Shapes: ``[..., hidden_size]`` -> same shape and dtype.  The weight carries ``sequence_parallel``.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32) if config is not None else torch.float32
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=param_device(config)))
        self.eps = eps
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(torch.nn.Module):
    """GDN output norm ``weight * (x / rms(x)).to(dtype) * silu(z)`` (transformers ``Qwen3_5MoeRMSNormGated``).

    Shapes: ``x``, ``z`` ``[..., hidden_size]`` -> same shape and dtype.  With ``tp_group`` the weight's
    gradient is all-reduced over TP (each rank sees only its value heads).
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32) if config is not None else torch.float32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=param_device(config)))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor, tp_group=None) -> torch.Tensor:
        dtype = x.dtype
        weight = self.weight
        if tp_group is not None and tp_group.size() > 1:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight, group=tp_group)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)

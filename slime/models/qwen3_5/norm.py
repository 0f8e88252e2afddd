"""The two RMSNorms of Qwen3.5, in transformers' numerics.

- :class:`ZeroCenteredRMSNorm`: ``y = x / rms(x) * (1 + w)`` with the weight stored zero-centred
  (a checkpoint's zeros mean the identity scale).  Used before attention / GDN / MoE, for the
  final norm and for the per-head q/k norms.  Source: transformers ``Qwen3_5MoeRMSNorm``.
- :class:`GatedRMSNorm`: the Gated DeltaNet output norm ``y = w * (x / rms(x)) * silu(z)`` per
  value head, weight stored as is (ones = identity).  Source: transformers
  ``Qwen3_5MoeRMSNormGated`` (norm before gate, as in fla's ``FusedRMSNormGated``).

``rms(x) = sqrt(mean(x**2) + eps)`` over the last dimension, computed in fp32; the output has the
input's dtype.  Both are plain ``torch.nn.Module``s with megatron-core's norm constructor
signature ``(config, hidden_size, eps)``, so a ``ModuleSpec`` can place them.  Their weights carry
``sequence_parallel`` so that megatron-core all-reduces their gradients across TP under SP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def param_device(config) -> torch.device | None:
    """Where megatron-core would allocate a parameter: the current GPU, unless ``use_cpu_initialization``.

    ``None`` (the ambient default device, e.g. ``meta`` inside ``with torch.device("meta")``) when
    ``use_cpu_initialization`` is set or CUDA is absent.  Every module of this package uses it.
    """
    if config is None or getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * (1 + weight)`` in fp32, cast back to ``x.dtype``.

    Args:
        config: megatron-core ``TransformerConfig`` (for ``params_dtype``, ``sequence_parallel``,
            the allocation device); ``None`` gives fp32 weights on the default device.
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square.

    Shapes: any ``[..., hidden_size]`` -> same shape and dtype.
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
    """Gated DeltaNet output norm: ``weight * (x / rms(x)).to(dtype) * silu(z)``.

    Args:
        config: as for :class:`ZeroCenteredRMSNorm`.
        hidden_size: the value-head dimension.
        eps: added to the mean square.

    Shapes: ``x`` and ``z`` ``[..., hidden_size]`` of one dtype -> same shape and dtype.  The
    order of casts follows transformers (normalise in fp32, scale in the input dtype, gate in fp32).

    Under tensor parallelism the Gated DeltaNet gives each rank its own value heads, so the weight
    (replicated, one per value-head dimension) gets a partial gradient on each rank; ``forward`` with
    ``tp_group`` reads it through megatron-core's ``copy_to_tensor_model_parallel_region`` (identity
    forward, all-reduce backward), so every rank holds the whole gradient, as for any replicated
    parameter.
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

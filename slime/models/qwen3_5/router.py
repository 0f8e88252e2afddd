"""The MoE router of Qwen3.5: megatron-core's ``TopKRouter``, with its weight left where the model put it.

Qwen3.5's router is a linear map ``[E, hidden]`` followed by a softmax over the top-k logits
(transformers ``Qwen3_5MoeTopKRouter``; megatron-core ``TopKRouter`` with
``moe_router_score_function='softmax'`` and ``moe_router_pre_softmax=False``, see
:mod:`slime.models.qwen3_5.config`).  megatron-core 0.16.1's ``TopKRouter.gating`` moves a CPU weight
to ``torch.cuda.current_device()`` on every call (a convenience for CPU-initialised GPU models),
which on a machine without CUDA raises.  :class:`Qwen35Router` computes the same gating with the
weight on its own device: the model is built on the device it runs on (CUDA in training, the CPU in
the CPU tests and tools), so the move is never needed.  Routing itself (top-k, softmax, routing
replay, the token dispatcher) is megatron-core's.
"""

from __future__ import annotations

import torch


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


class Qwen35Router(_router_class()):
    """megatron-core's ``TopKRouter`` whose gating GEMM runs on the weight's own device.

    ``gating(input [N, hidden]) -> logits [N, E]`` in the router dtype (``moe_router_dtype``:
    fp32 / fp64, default the input's), through megatron-core's ``router_gating_linear``.
    """

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

"""Routed experts of Qwen3.5's MoE layers as two grouped GEMMs (``torch._grouped_mm``).

megatron-core's ``MoELayer`` routes, permutes the tokens by local expert and calls the experts module;
without TransformerEngine or ``grouped_gemm`` its own is a Python loop (``SequentialMLP``).  This one is
the SwiGLU expert of transformers' ``Qwen3_5MoeExperts``, routing probability applied to the output:

    h = grouped(tokens, W1^T)                    W1 [E_local, 2 I, hidden] = [gate_e; up_e] per expert
    y = grouped(silu(h_gate) * h_up, W2^T) * p   W2 [E_local, hidden, I]

Under expert tensor parallelism ``I`` is split and megatron-core's dispatcher reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime.models.qwen3_5.norm import param_device


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w[e]``.

    ``x [N, K]`` sorted by group, ``w [E, K, M]``, ``offsets [E]`` int32 group ends -> ``[N, M]`` in ``x.dtype``.
    """
    return torch._grouped_mm(x, w.to(x.dtype), offs=offsets)


class GroupedExperts(torch.nn.Module):
    """All local experts of one MoE layer (megatron-core's experts-module interface).

    Parameters: ``weight1 [E_local, 2 I_r, hidden]`` (rows ``[gate | up]`` per expert), ``weight2 [E_local,
    hidden, I_r]``, ``I_r = moe_ffn_hidden_size / ETP`` (``pg_collection.expt_tp``).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        super().__init__()
        etp_group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        if etp_group is None:
            from megatron.core import parallel_state

            etp_group = parallel_state.get_expert_tensor_parallel_group()
        etp = etp_group.size()
        self.config = config
        self.num_local_experts = num_local_experts
        inter = config.moe_ffn_hidden_size // etp
        device, dtype = param_device(config), config.params_dtype
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * inter, config.hidden_size, device=device, dtype=dtype))
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, config.hidden_size, inter, device=device, dtype=dtype))
        if config.perform_initialization and self.weight1.device.type != "meta":
            with torch.no_grad():
                config.init_method(self.weight1)
                config.output_layer_init_method(self.weight2)
        expert_parallel = config.expert_model_parallel_size > 1
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        for p, dim in ((self.weight1, 1), (self.weight2, 2)):
            # megatron-core's DDP: expert weights are reduced over the expert-data-parallel group.
            setattr(p, "allreduce", not expert_parallel)
            # Split over expert-TP along the intermediate dimension: the gradient norm counts every shard
            # (unsplit, every expert-TP rank holds the whole weight and one copy counts).
            set_tensor_model_parallel_attributes(p, is_parallel=etp > 1, dim=dim, stride=1)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """``tokens [N, hidden]`` sorted by expert, ``tokens_per_expert [E_local]``, ``probs [N]`` -> ``(out, None)``.
        """
        if tokens.shape[0] == 0:  # every token went to other EP ranks: keep the weights in the graph
            return tokens.new_zeros(0, tokens.shape[-1]) + 0 * (self.weight1.sum() + self.weight2.sum()), None
        offsets = torch.cumsum(tokens_per_expert.to(device=tokens.device), 0, dtype=torch.int32)
        h = grouped_mm(tokens, self.weight1.transpose(1, 2), offsets)
        gate, up = h.chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.weight2.transpose(1, 2), offsets)
        return out * probs.unsqueeze(-1).to(out.dtype), None

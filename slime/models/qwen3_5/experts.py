"""Routed experts of Qwen3.5's MoE layers as two grouped GEMMs (``torch._grouped_mm``).

megatron-core's ``MoELayer`` routes (softmax over the top-k router logits), permutes the tokens so
that each local expert's tokens are contiguous, and calls the experts module with
``(tokens [N, hidden], tokens_per_expert [E_local], probs [N])``.  Without TransformerEngine or the
``grouped_gemm`` package its only experts module is a Python loop over experts (``SequentialMLP``);
this one runs every local expert in one ``torch._grouped_mm`` per projection:

    h = grouped(tokens, W1^T)                    W1 [E_local, 2 I, hidden] = [gate_e; up_e] per expert
    y = grouped(silu(h_gate) * h_up, W2^T) * p   W2 [E_local, hidden, I]

the SwiGLU expert of transformers' ``Qwen3_5MoeExperts``, whose in-memory ``gate_up_proj`` /
``down_proj`` have the same layouts, with the routing probability applied to the expert output
as there.  Under expert tensor parallelism (ETP) the intermediate dimension ``I`` is split and
megatron-core's dispatcher reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime.models.qwen3_5.norm import param_device


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w[e]``.

    Args:
        x: ``[N, K]``, rows sorted by group.
        w: ``[E, K, M]`` (any strides torch accepts; a transposed ``[E, M, K]`` view is fine).
        offsets: ``[E]`` int32 cumulative row counts (end of each group).

    Returns:
        ``[N, M]`` in ``x.dtype``.
    """
    return torch._grouped_mm(x, w.to(x.dtype), offs=offsets)


class GroupedExperts(torch.nn.Module):
    """All local experts of one MoE layer (megatron-core's experts-module interface).

    Args:
        num_local_experts: experts on this EP rank (``num_experts / EP``).
        config: megatron-core ``TransformerConfig`` (``hidden_size``, ``moe_ffn_hidden_size``,
            ``params_dtype``, ``expert_model_parallel_size``).
        pg_collection: megatron-core process groups (``.expt_tp`` sets the ETP split).

    Parameters: ``weight1 [E_local, 2 I_r, hidden]`` (rows ``[gate (I_r) | up (I_r)]`` per expert),
    ``weight2 [E_local, hidden, I_r]``, ``I_r = moe_ffn_hidden_size / ETP``.
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
        """``tokens [N, hidden]`` sorted by local expert, ``tokens_per_expert [E_local]``, ``probs [N]``
        -> ``(out [N, hidden], None)``."""
        if tokens.shape[0] == 0:  # every token went to other EP ranks: keep the weights in the graph
            return tokens.new_zeros(0, tokens.shape[-1]) + 0 * (self.weight1.sum() + self.weight2.sum()), None
        offsets = torch.cumsum(tokens_per_expert.to(device=tokens.device), 0, dtype=torch.int32)
        h = grouped_mm(tokens, self.weight1.transpose(1, 2), offsets)
        gate, up = h.chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.weight2.transpose(1, 2), offsets)
        return out * probs.unsqueeze(-1).to(out.dtype), None

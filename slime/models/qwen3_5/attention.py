"""Gated full attention of Qwen3.5 over packed documents (THD), as a megatron-core attention submodule.

Math (transformers ``Qwen3_5MoeAttention``; output gate of Qiu et al., "Gated Attention for Large
Language Models", 2025):

    q, gate = q_proj(x) per head;  k, v = k_proj(x), v_proj(x)
    q, k = RMSNorm_(1+w)(q), RMSNorm_(1+w)(k)            per head, over head_dim
    q, k = MRoPE(q), MRoPE(k)                             first rotary_dim dims (slime.models.qwen3_5.rope)
    o = softmax(q k^T / sqrt(head_dim) + causal, per document) v     GQA: query head h reads KV head h // (H / H_kv)
    out = o_proj(o * sigmoid(gate))

``linear_qkv`` (column-parallel) holds per TP rank ``[q (Hr d) | gate (Hr d) | k (Hkv_r d) | v (Hkv_r d)]``
(``Hr = H / tp``, ``Hkv_r = H_kv / tp``); ``linear_proj`` is row-parallel.  Selective recompute
(``core_attn``) reruns the kernel in the backward pass (non-reentrant checkpoint; no dropout, no RNG).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from slime.models.qwen3_5.norm import ZeroCenteredRMSNorm
from slime.models.qwen3_5.packing import packing_from_params
from slime.models.qwen3_5.rope import apply_rotary


def recomputes_core(config) -> bool:
    """Whether megatron-core's config asks to recompute the core attention (selective recompute)."""
    return config.recompute_granularity == "selective" and "core_attn" in (config.recompute_modules or ["core_attn"])


def maybe_recompute(enabled: bool, fn, *args):
    """``fn(*args)``, recomputed in the backward pass when ``enabled`` and autograd records (training)."""
    if enabled and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def varlen_causal_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """Causal attention per packed document with torch's FlashAttention-2 varlen kernel.

    Args:
        q: ``[T, H, d]``; k, v: ``[T, H_kv, d]``; bf16/fp16 on CUDA.
        cu_seqlens: ``[n + 1]`` int32 document boundaries.
        max_seqlen: longest document.

    Returns:
        ``[T, H, d]``.
    """
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {"window_size": (-1, 0)}
    if "enable_gqa" in inspect.signature(varlen_attn).parameters and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def sdpa_causal_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> torch.Tensor:
    """As :func:`varlen_causal_attention` (any dtype), one ``scaled_dot_product_attention`` per document."""
    bounds = cu_seqlens.tolist()
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qd, kd, vd = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if groups > 1:
            kd, vd = kd.repeat_interleave(groups, dim=1), vd.repeat_interleave(groups, dim=1)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


class GatedAttention(torch.nn.Module):
    """Qwen3.5 gated full attention as megatron-core's ``self_attention`` submodule.

    Args:
        config: megatron-core ``TransformerConfig``.
        layer_number: 1-based global layer number.
        pg_collection: megatron-core process groups (``.tp``); default: the global ones.
        attention_kernel: ``"varlen"`` or ``"sdpa"``.

    Forward: ``hidden_states [S, 1, hidden]``, ``rotary_pos_emb [T, rotary_dim]`` angles, ``packed_seq_params``
    -> ``(out [S, 1, hidden], None)``.
    """

    def __init__(self, config, layer_number: int = 1, pg_collection=None, attention_kernel: str = "varlen",
                 **kwargs):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.config = config
        self.layer_number = layer_number
        self.attention_kernel = attention_kernel
        self.recompute_core = recomputes_core(config)
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = tp_group.size()
        self.head_dim = config.kv_channels
        self.heads = config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        width = (2 * config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, width, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_bias_add=True, tp_group=tp_group,
        )
        self.q_layernorm = ZeroCenteredRMSNorm(config, self.head_dim, eps=config.layernorm_epsilon)
        self.k_layernorm = ZeroCenteredRMSNorm(config, self.head_dim, eps=config.layernorm_epsilon)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            tp_group=tp_group,
        )

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        qkv, _ = self.linear_qkv(hidden_states)  # [T, B, width_r]
        total, batch = qkv.shape[:2]
        packing = packing_from_params(packed_seq_params, total, batch, qkv.device)
        qkv = qkv.transpose(0, 1).reshape(batch * total, -1)
        d = self.head_dim
        q, gate, k, v = torch.split(qkv, [self.heads * d, self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = self.q_layernorm(q.reshape(-1, self.heads, d))
        k = self.k_layernorm(k.reshape(-1, self.kv_heads, d))
        v = v.reshape(-1, self.kv_heads, d)
        if rotary_pos_emb is not None:
            freqs = rotary_pos_emb.reshape(-1, rotary_pos_emb.shape[-1])
            if batch > 1 and freqs.shape[0] == total:
                freqs = freqs.repeat(batch, 1)
            q, k = apply_rotary(q, freqs), apply_rotary(k, freqs)
        attend = varlen_causal_attention if self.attention_kernel == "varlen" else sdpa_causal_attention
        o = maybe_recompute(self.recompute_core, attend, q, k, v, packing.cu_seqlens, packing.max_seqlen)
        o = o.reshape(-1, self.heads * d) * torch.sigmoid(gate)
        o = o.reshape(batch, total, -1).transpose(0, 1)
        out, _ = self.linear_proj(o)
        return out, None

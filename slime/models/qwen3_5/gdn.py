"""Gated DeltaNet (GDN) linear-attention layer of Qwen3.5, packed (THD), sharded by heads under TP.

Math (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10; transformers
``Qwen3_5MoeGatedDeltaNet``), per value head, state ``S [d_k, d_v]`` zero at every document start:

    q_t, k_t = l2norm(q_t) / sqrt(d_k), l2norm(k_t)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
    o_t = S_t^T q_t
    g_t = -exp(A_log) * softplus(a_t + dt_bias),   beta_t = sigmoid(b_t)

``q, k, v`` come from a depthwise causal convolution + SiLU of ``in_proj_qkv(x)`` that restarts at
every document; ``o`` goes through a gated RMSNorm with ``z = in_proj_z(x)`` and ``out_proj``.  Value
head ``j`` reads key head ``j // (V / K)``.  TP rank ``r`` holds key heads ``[r K/tp, (r+1) K/tp)`` and
value heads ``[r V/tp, (r+1) V/tp)`` (as torchtitan's ``models/qwen3_5``); ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime.models.qwen3_5.attention import maybe_recompute
from slime.models.qwen3_5.norm import GatedRMSNorm, param_device
from slime.models.qwen3_5.packing import PackedSequences, packing_from_params


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d_packed(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution + SiLU, zero left-padding per document (taps before its start are dropped).

    Args:
        x: ``[T, C]`` packed channels.
        weight: ``[C, K]`` depthwise kernel (``conv1d.weight[:, 0, :]``).
        positions: ``[T]`` int64 position of each token in its document.

    Returns:
        ``[T, C]`` in ``x.dtype`` (accumulated in ``weight.dtype``, as transformers' ``conv1d``).
    """
    kernel = weight.shape[-1]
    xw = x.to(weight.dtype)
    out = xw * weight[:, kernel - 1]
    for j in range(1, kernel):
        shifted = F.pad(xw, (0, 0, j, 0))[: xw.shape[0]]
        keep = (positions >= j).to(xw.dtype).unsqueeze(-1)
        out = out + shifted * keep * weight[:, kernel - 1 - j]
    return F.silu(out).to(x.dtype)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    packing: PackedSequences,
    *,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The gated delta rule over packed documents in fp32, chunked (WY form: Yang et al., NeurIPS 2024, sec. 3).

    Args:
        q, k: ``[T, H, d_k]`` already repeated to the value heads; L2-normalised here.
        v: ``[T, H, d_v]``.
        g: ``[T, H]`` log decay (<= 0); beta: ``[T, H]`` in (0, 1).
        packing: the documents (state restarts at each); chunk_size: tokens per chunk ``C``.

    Returns:
        ``[T, H, d_v]`` in ``v.dtype``.

    Per chunk with in-chunk cumulative decay ``G_i = sum_{j<=i} g_j`` and incoming state ``S``:
    ``U = (I + A)^{-1} (beta V - beta exp(G) K S)`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j``
    (``j < i``); ``O = exp(G) Q S + (Q K^T * D) U`` with ``D_ij = exp(G_i - G_j)`` (``j <= i``);
    ``S' = exp(G_C) S + (exp(G_C - G) K)^T U``.
    """
    dtype = v.dtype
    d_k = q.shape[-1]
    q = l2norm(q.float()) * d_k**-0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    padded = -(-packing.max_seqlen // chunk_size) * chunk_size
    # [n, Lp, H, .] -> [n, H, N, C, .]
    qb, kb, vb = (packing.to_batch(x, padded) for x in (q, k, v))
    gb, bb = packing.to_batch(g, padded), packing.to_batch(beta, padded)
    n, _, heads, _ = qb.shape
    chunks = padded // chunk_size

    def to_chunks(x):
        return x.transpose(1, 2).reshape(n, heads, chunks, chunk_size, *x.shape[3:])

    qc, kc, vc, gc, bc = (to_chunks(x) for x in (qb, kb, vb, gb, bb))
    cum = gc.cumsum(-1)  # [n, H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # D_ij = exp(G_i - G_j) for j <= i, else 0
    k_beta = kc * bc.unsqueeze(-1)
    a = (k_beta @ kc.transpose(-1, -2)) * decay
    a = a.tril(-1)  # strictly lower: j < i
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    rhs = torch.cat([vc * bc.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_v, u_k = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1]:]
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_decay = qc * cum.exp().unsqueeze(-1)
    k_tail = kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    state = q.new_zeros(n, heads, d_k, vc.shape[-1])
    outs = []
    for c in range(chunks):
        u = u_v[:, :, c] - u_k[:, :, c] @ state
        outs.append(q_decay[:, :, c] @ state + attn[:, :, c] @ u)
        state = state * cum[:, :, c, -1].exp()[..., None, None] + k_tail[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(n, heads, padded, -1).transpose(1, 2)  # [n, Lp, H, d_v]
    return packing.from_batch(o).to(dtype)


def _fla_chunk_gated_delta_rule():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla_causal_conv1d():
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


class GatedDeltaNet(torch.nn.Module):
    """One Gated DeltaNet token mixer, as megatron-core's ``self_attention`` submodule of a layer.

    Args:
        config: megatron-core ``TransformerConfig``.
        layer_number: 1-based global layer number.
        pg_collection: megatron-core process groups (``.tp``); default: the global ones.
        gdn_kernel, conv_kernel: ``"fla"`` or ``"torch"`` (:class:`slime.models.qwen3_5.config.Qwen35Kernels`).

    Parameters (TP-local; ``Kr = K / tp``, ``Vr = V / tp``): ``in_proj.weight [2 Kr d_k + 2 Vr d_v + 2 Vr,
    hidden]`` (rows ``[q | k | v | z | b | a]``), ``conv1d.weight [2 Kr d_k + Vr d_v, 1, K_conv]``, ``A_log [Vr]``
    (fp32), ``dt_bias [Vr]``, ``norm.weight [d_v]``, ``out_proj.weight [hidden, Vr d_v]``.
    """

    def __init__(self, config, layer_number: int = 1, pg_collection=None, gdn_kernel: str = "fla",
                 conv_kernel: str = "fla", **kwargs):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        from slime.models.qwen3_5.attention import recomputes_core

        self.config = config
        self.layer_number = layer_number
        self.gdn_kernel, self.conv_kernel = gdn_kernel, conv_kernel
        self.recompute_core = recomputes_core(config)  # selective recompute of the delta-rule kernel
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = tp_group.size()
        self.d_k, self.d_v = config.linear_key_head_dim, config.linear_value_head_dim
        self.k_heads, self.v_heads = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
        self.key_dim, self.value_dim = self.k_heads * self.d_k, self.v_heads * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        full_out = 2 * config.linear_num_key_heads * self.d_k + 2 * config.linear_num_value_heads * (self.d_v + 1)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, full_out, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_bias_add=True, tp_group=tp_group,
        )
        device, dtype = param_device(config), config.params_dtype
        kernel = config.linear_conv_kernel_dim
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(torch.empty(self.conv_dim, 1, kernel, device=device, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.v_heads, device=device, dtype=torch.float32))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads, device=device, dtype=dtype))
        self.norm = GatedRMSNorm(config, self.d_v, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            config.linear_num_value_heads * self.d_v, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            tp_group=tp_group,
        )
        if config.perform_initialization and self.A_log.device.type != "meta":
            with torch.no_grad():
                bound = 1.0 / kernel**0.5  # torch.nn.Conv1d's default for a depthwise kernel
                self.conv1d.weight.uniform_(-bound, bound)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())  # transformers' init
        # A_log stays fp32 under bf16 training (as SGLang holds it); the trainer must keep it so.
        setattr(self.A_log, "keep_fp32", True)
        # Split over TP by heads (dim 0): megatron-core's gradient norm counts every rank's shard.
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        self.tp_group = tp_group

    def _delta_rule(self, q, k, v, g, beta, packing: PackedSequences) -> torch.Tensor:
        if self.gdn_kernel == "fla":
            o, _ = _fla_chunk_gated_delta_rule()(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                use_qk_l2norm_in_kernel=True, cu_seqlens=packing.cu_seqlens.long(),
            )
            return o.squeeze(0)
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, packing)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **kwargs):
        """``[S, 1, hidden]`` -> ``(out [S, 1, hidden], None)``; no ``packed_seq_params``: a document per column."""
        seq, batch, _ = hidden_states.shape
        proj, _ = self.in_proj(hidden_states)  # [T, B, out_r] (gathered over SP)
        total = proj.shape[0]
        proj = proj.transpose(0, 1).reshape(batch * total, -1)
        packing = packing_from_params(packed_seq_params, total, batch, proj.device)
        splits = [self.key_dim, self.key_dim, self.value_dim, self.value_dim, self.v_heads, self.v_heads]
        q, k, v, z, b, a = torch.split(proj, splits, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1)
        conv_w = self.conv1d.weight[:, 0, :]
        if self.conv_kernel == "fla":
            qkv, _ = _fla_causal_conv1d()(qkv.unsqueeze(0), weight=conv_w, activation="silu",
                                          cu_seqlens=packing.cu_seqlens.long())
            qkv = qkv.squeeze(0)
        else:
            qkv = causal_conv1d_packed(qkv, conv_w, packing.positions())
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(-1, self.k_heads, self.d_k)
        k = k.reshape(-1, self.k_heads, self.d_k)
        v = v.reshape(-1, self.v_heads, self.d_v)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        ratio = self.v_heads // self.k_heads
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        o = maybe_recompute(self.recompute_core, self._delta_rule, q, k, v, g, beta, packing)
        o = self.norm(o, z.reshape(-1, self.v_heads, self.d_v), tp_group=self.tp_group)
        o = o.reshape(batch, total, self.value_dim).transpose(0, 1)
        out, _ = self.out_proj(o)
        return out, None


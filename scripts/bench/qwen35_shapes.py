"""Shared by the Qwen3.5 benchmarks: the FLOP count of a training step of the scaled Qwen3.5-35B-A3B
(:func:`slime.checkpoints.scaled_qwen35.scaled_config`: the released widths, layers and experts cut).

FLOPs (multiply-add = 2 FLOPs; a training step = 3 x forward: forward, and a backward of twice its cost):

- language model, per token: 2 x the active matmul parameters (GDN in/out projections, attention
  q(+gate)/k/v/o projections, router, top-k experts x 3 matrices, shared expert and its gate), plus the
  GDN core 6 dk dv per value head (state update 4 dk dv, read-out 2 dk dv);
- causal attention core: ``QK^T`` and ``PV`` over the causal half, 2 x 2 x heads x head_dim x L^2 / 2 per
  document of length L;
- LM head: 2 x hidden x vocab per token whose logits are computed (``lm_head_tokens``; a trainer that
  needs the responses' log-probs only computes it at the response positions);
- vision tower, per patch: 2 x the parameters of every ViT block (qkv, projection, MLP) plus the
  non-causal attention core 2 x 2 x hidden x P per patch of an image of P patches; the merger (2x2
  patches -> one token) per merged token: 2 x its parameters.
"""

from __future__ import annotations


def lm_flops_per_token(arch) -> float:
    """Forward FLOPs per token of the language model without the LM head and the attention core."""
    h = arch.hidden_size
    K, V = arch.linear_num_key_heads, arch.linear_num_value_heads
    dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
    H, Hkv, d = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    gdn_params = h * (2 * K * dk + 2 * V * dv + 2 * V) + V * dv * h
    attn_params = h * (2 * H * d + 2 * Hkv * d) + H * d * h
    moe_params = h * arch.num_experts + arch.moe_router_topk * 3 * h * arch.moe_ffn_hidden_size \
        + 3 * h * arch.shared_expert_intermediate_size + h
    n_gdn = sum(k == "linear_attention" for k in arch.layer_types)
    n_attn = arch.num_layers - n_gdn
    return 2 * (n_gdn * gdn_params + n_attn * attn_params + arch.num_layers * moe_params) + n_gdn * V * 6 * dk * dv


def attention_core_flops(arch, doc_lengths: list[int]) -> float:
    """Forward FLOPs of the causal attention cores over documents of ``doc_lengths`` tokens."""
    n_attn = sum(k == "full_attention" for k in arch.layer_types)
    H, d = arch.num_attention_heads, arch.head_dim
    return n_attn * sum(2 * 2 * H * d * L * L / 2 for L in doc_lengths)


def vision_flops(vision: dict, image_patches: list[int]) -> float:
    """Forward FLOPs of the vision tower over images of ``image_patches`` patches each (module docstring)."""
    h, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    m = vision.get("spatial_merge_size", 2) ** 2
    block_params = 4 * h * h + 2 * h * inter
    merger_params = (h * m) * (h * m) + (h * m) * vision["out_hidden_size"]
    patches = sum(image_patches)
    core = depth * sum(2 * 2 * h * p * p for p in image_patches)
    patch_embed = 2 * vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2 * h * patches
    return 2 * depth * block_params * patches + core + 2 * merger_params * patches / m + patch_embed


def flops_per_step(arch, doc_lengths: list[int], *, lm_head_tokens: int | None = None,
                   image_patches: list[int] = ()) -> float:
    """Training FLOPs (3 x forward) of one step over documents of ``doc_lengths`` tokens (module docstring).

    Args:
        arch: :class:`slime.models.qwen3_5.config.Qwen35Arch`.
        doc_lengths: tokens per packed document.
        lm_head_tokens: tokens whose logits are computed (default: every token).
        image_patches: patches per image (empty: no vision FLOPs counted).
    """
    tokens = sum(doc_lengths)
    head = 2 * arch.hidden_size * arch.vocab_size * (tokens if lm_head_tokens is None else lm_head_tokens)
    forward = lm_flops_per_token(arch) * tokens + attention_core_flops(arch, doc_lengths) + head
    if image_patches:
        forward += vision_flops(arch.vision_config, list(image_patches))
    return 3 * forward

"""megatron-core ``ModuleSpec``s of the Qwen3.5-MoE decoder: which module fills each slot of a layer.

A layer is megatron-core's ``TransformerLayer`` with :class:`~slime.models.qwen3_5.norm.ZeroCenteredRMSNorm`
norms; as ``self_attention`` :class:`~slime.models.qwen3_5.gdn.GatedDeltaNet` (``linear_attention``) or
:class:`~slime.models.qwen3_5.attention.GatedAttention` (``full_attention``); as ``mlp`` megatron-core's
``MoELayer`` with :class:`~slime.models.qwen3_5.router.Qwen35Router`,
:class:`~slime.models.qwen3_5.experts.GroupedExperts` and ``SharedExpertMLP`` (sigmoid gate).
"""

from __future__ import annotations

from slime.models.qwen3_5.config import Qwen35Config, Qwen35Kernels


def qwen35_layer_spec(layer_type: str, kernels: Qwen35Kernels = Qwen35Kernels()):
    """The ``ModuleSpec`` of one Qwen3.5 layer (``layer_type`` ``"linear_attention"`` or ``"full_attention"``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from slime.models.qwen3_5.attention import GatedAttention
    from slime.models.qwen3_5.experts import GroupedExperts
    from slime.models.qwen3_5.gdn import GatedDeltaNet
    from slime.models.qwen3_5.norm import ZeroCenteredRMSNorm
    from slime.models.qwen3_5.router import Qwen35Router

    if layer_type == "linear_attention":
        mixer = ModuleSpec(module=GatedDeltaNet, params={"gdn_kernel": kernels.gdn, "conv_kernel": kernels.gdn_conv})
    elif layer_type == "full_attention":
        mixer = ModuleSpec(module=GatedAttention, params={"attention_kernel": kernels.attention})
    else:
        raise ValueError(f"layer_type must be 'linear_attention' or 'full_attention', got {layer_type!r}")
    shared = ModuleSpec(module=SharedExpertMLP,
                        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    moe = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=ModuleSpec(module=GroupedExperts),
                                                               shared_experts=shared, router=Qwen35Router))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ZeroCenteredRMSNorm,
            mlp=moe,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def qwen35_block_spec(config: Qwen35Config, *, pp_rank: int | None = None, vp_stage: int | None = None):
    """``TransformerBlockSubmodules`` of this pipeline stage's layers (megatron-core's layer offsets)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from slime.models.qwen3_5.norm import ZeroCenteredRMSNorm

    tc = config.transformer
    specs = [qwen35_layer_spec(kind, config.kernels) for kind in config.arch.layer_types]
    count = get_num_layers_to_build(tc, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(tc, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset: offset + count], layer_norm=ZeroCenteredRMSNorm)

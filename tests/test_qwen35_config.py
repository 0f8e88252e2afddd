"""The HF config -> native-model config translator against the MODEL_ARGS of scripts/models/*.sh.

The expected values come from the .sh files' Megatron flags (parsed by ``test_model_args.model_args``),
mapped here to megatron-core ``TransformerConfig`` fields independently of the translator.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_model_args import MODELS, model_args

from slime.models.qwen3_5.config import (
    ParallelLayout, Qwen35ConfigError, arch_from_hf_config, check_parallel_layout, qwen35_config_from_hf,
)

pytest.importorskip("megatron.core")

FLAG_TO_FIELD = {
    "--num-layers": ("num_layers", int),
    "--hidden-size": ("hidden_size", int),
    "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--num-attention-heads": ("num_attention_heads", int),
    "--num-query-groups": ("num_query_groups", int),
    "--kv-channels": ("kv_channels", int),
    "--num-experts": ("num_moe_experts", int),
    "--moe-router-topk": ("moe_router_topk", int),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", int),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", int),
    "--moe-router-score-function": ("moe_router_score_function", str),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", float),
    "--norm-epsilon": ("layernorm_epsilon", float),
    "--normalization": ("normalization", str),
    "--linear-conv-kernel-dim": ("linear_conv_kernel_dim", int),
    "--linear-key-head-dim": ("linear_key_head_dim", int),
    "--linear-value-head-dim": ("linear_value_head_dim", int),
    "--linear-num-key-heads": ("linear_num_key_heads", int),
    "--linear-num-value-heads": ("linear_num_value_heads", int),
}
SWITCH_TO_FIELD = {
    "--qk-layernorm": ("qk_layernorm", True),
    "--attention-output-gate": ("attention_output_gate", True),
    "--apply-layernorm-1p": ("layernorm_zero_centered_gamma", True),
    "--swiglu": ("gated_linear_unit", True),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--moe-shared-expert-gate": ("moe_shared_expert_gate", True),
}
ARCH_FLAGS = {
    "--rotary-percent": ("rotary_percent", float),
    "--rotary-base": ("rope_theta", float),
    "--vocab-size": ("vocab_size", int),
    "--max-position-embeddings": ("max_position_embeddings", int),
}


def assert_translation_matches_flags(hf_config: dict, script: str) -> None:
    args = model_args(MODELS / script)
    config = qwen35_config_from_hf(hf_config, params_dtype=torch.float32)
    tc, arch = config.transformer, config.arch
    for flag, (field, cast) in FLAG_TO_FIELD.items():
        assert getattr(tc, field) == cast(args[flag]), f"{flag} {args[flag]} vs TransformerConfig.{field} {getattr(tc, field)}"
    for flag, (field, value) in SWITCH_TO_FIELD.items():
        assert args.get(flag) is True and getattr(tc, field) is value, f"{flag} vs TransformerConfig.{field}"
    for flag, (field, cast) in ARCH_FLAGS.items():
        assert getattr(arch, field) == cast(args[flag]), f"{flag} {args[flag]} vs arch.{field} {getattr(arch, field)}"
    # --linear-attention-freq N: layer i (0-based) is full attention iff (i + 1) % N == 0; 1 = GDN.
    n = int(args["--linear-attention-freq"])
    assert tc.linear_attention_freq == [int((i + 1) % n != 0) for i in range(tc.num_layers)]
    assert args["--moe-layer-freq"] == "1" and tc.num_moe_experts  # every layer MoE
    assert args["--untie-embeddings-and-output-weights"] is True  # the translator refuses tied embeddings
    assert args["--group-query-attention"] is True and tc.num_query_groups < tc.num_attention_heads
    assert tc.moe_router_pre_softmax is False and tc.moe_router_load_balancing_type == "none"


def test_35b_a3b_translation_matches_model_args():
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig().to_dict()
    # The released checkpoint's values where transformers' defaults differ (rope_theta 1e4, 32768 positions).
    config["text_config"]["rope_parameters"]["rope_theta"] = 1e7
    config["text_config"]["max_position_embeddings"] = 262144
    assert_translation_matches_flags(config, "qwen3.5-35B-A3B.sh")
    arch = arch_from_hf_config(config)
    assert (arch.rotary_dim, arch.mrope_section, arch.mrope_interleaved) == (64, (11, 11, 10), True)


def test_tiny_translation_matches_model_args(tiny_ckpt):
    assert_translation_matches_flags(json.loads((tiny_ckpt / "config.json").read_text()), "qwen3.5-tiny.sh")


def test_padded_vocab_only_when_tp_does_not_divide():
    from transformers import Qwen3_5MoeConfig

    arch = arch_from_hf_config(Qwen3_5MoeConfig().to_dict())
    assert arch.vocab_size == 248320
    assert [arch.padded_vocab_size(tp) for tp in (1, 2, 8)] == [248320, 248320, 248320]
    assert arch.padded_vocab_size(3) == 248322


@pytest.mark.parametrize(
    "layout, match",
    [
        (ParallelLayout(tensor_model_parallel_size=4), "num_key_value_heads 2"),
        (ParallelLayout(tensor_model_parallel_size=32), "linear_num_key_heads 16"),
        (ParallelLayout(expert_model_parallel_size=3), "--expert-model-parallel-size 3 must divide num_experts 256"),
        (ParallelLayout(context_parallel_size=2), "--context-parallel-size 2"),
    ],
)
def test_unshardable_layouts_name_the_flag(layout, match):
    from transformers import Qwen3_5MoeConfig

    with pytest.raises(Qwen35ConfigError, match=match):
        check_parallel_layout(arch_from_hf_config(Qwen3_5MoeConfig().to_dict()), layout)


def test_partly_known_sizes_check_only_their_rules():
    """The parse-time form: sizes that MODEL_ARGS or a config.json leave out skip their rules; the
    ones given are checked by the same rules as the model build's."""
    from transformers import Qwen3_5MoeConfig

    from slime.models.qwen3_5.config import ShardedSizes

    tp8 = ParallelLayout(tensor_model_parallel_size=8)
    check_parallel_layout(ShardedSizes(), tp8)  # nothing known: only layout rules (CP) apply
    check_parallel_layout(ShardedSizes(num_attention_heads=16), tp8)
    with pytest.raises(Qwen35ConfigError, match=r"^--tensor-model-parallel-size 8 must divide --num-query-groups 2 \(replicating"):
        check_parallel_layout(ShardedSizes(num_query_groups=2, names={"num_query_groups": "--num-query-groups"}), tp8)
    with pytest.raises(Qwen35ConfigError, match="exceeds num_hidden_layers 40 of c/config.json"):
        check_parallel_layout(ShardedSizes(num_layers=40, source="c/config.json"),
                              ParallelLayout(pipeline_model_parallel_size=41))
    with pytest.raises(Qwen35ConfigError, match="--context-parallel-size 2"):
        check_parallel_layout(ShardedSizes(), ParallelLayout(context_parallel_size=2))

    # a config.json: the same sizes as the arch (35B-A3B: 2 KV heads, 16 GDN key heads, 256 experts);
    # a field it lacks (or of another type) is unknown, not an error
    config = Qwen3_5MoeConfig().to_dict()
    sizes = ShardedSizes.from_hf_config(config, "c/config.json")
    assert sizes == arch_from_hf_config(config).sharded_sizes("c/config.json")
    assert (sizes.num_query_groups, sizes.linear_num_key_heads, sizes.num_experts) == (2, 16, 256)
    del config["text_config"]["num_key_value_heads"]
    config["text_config"]["num_experts"] = "256"
    partial = ShardedSizes.from_hf_config(config)
    assert partial.num_query_groups is None and partial.num_experts is None and partial.num_attention_heads == 16


def test_unsupported_checkpoint_fields_are_named(tiny_ckpt):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(Qwen35ConfigError, match="hidden_act = 'gelu'"):
        arch_from_hf_config(config, source="x/config.json")
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(Qwen35ConfigError, match=r"mrope_section \[2, 2, 2\] must have 3 entries summing to"):
        arch_from_hf_config(config)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    del config["text_config"]["linear_key_head_dim"]
    with pytest.raises(Qwen35ConfigError, match="'linear_key_head_dim' is missing"):
        arch_from_hf_config(config)

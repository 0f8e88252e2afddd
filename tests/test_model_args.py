"""scripts/models/qwen3.5-*.sh against the HF configs they describe, field by field.

The expected flags are derived here from an HF text config (transformers' Qwen3_5MoeConfig()
defaults for 35B-A3B, the built config.json for the tiny model), independently of the .sh files.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "scripts" / "models"


def model_args(script: Path) -> dict[str, str | bool]:
    """``MODEL_ARGS`` of a sourced model file as {flag: value}, ``True`` for a switch.

    Raises ``ValueError`` on a repeated flag or a value without a flag.
    """
    out = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\n" "${MODEL_ARGS[@]}"', "bash", str(script)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    args: dict[str, str | bool] = {}
    i = 0
    while i < len(out):
        flag = out[i]
        if not flag.startswith("--"):
            raise ValueError(f"{script.name}: value {flag!r} without a flag")
        if flag in args:
            raise ValueError(f"{script.name}: {flag} is given twice")
        has_value = i + 1 < len(out) and not out[i + 1].startswith("--")
        args[flag] = out[i + 1] if has_value else True
        i += 2 if has_value else 1
    return args


def expected_flags(text: dict) -> dict[str, str | bool]:
    """The Megatron flags of an HF Qwen3.5-MoE ``text_config`` (as a dict)."""
    layer_types = text["layer_types"]
    interval = layer_types.index("full_attention") + 1
    # Megatron's --linear-attention-freq N: layer i (0-based) is full attention iff (i + 1) % N == 0.
    assert layer_types == [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))
    ], "layer pattern is not periodic"
    rope = text["rope_parameters"]
    assert text["hidden_act"] == "silu" and text["attention_bias"] is False and not text["tie_word_embeddings"]
    return {
        "--num-layers": str(text["num_hidden_layers"]),
        "--hidden-size": str(text["hidden_size"]),
        "--num-attention-heads": str(text["num_attention_heads"]),
        "--group-query-attention": True,
        "--num-query-groups": str(text["num_key_value_heads"]),
        "--kv-channels": str(text["head_dim"]),
        "--num-experts": str(text["num_experts"]),
        "--moe-router-topk": str(text["num_experts_per_tok"]),
        "--moe-ffn-hidden-size": str(text["moe_intermediate_size"]),
        "--moe-shared-expert-intermediate-size": str(text["shared_expert_intermediate_size"]),
        "--moe-shared-expert-gate": True,
        "--moe-layer-freq": "1",
        "--rotary-percent": rope["partial_rotary_factor"],
        "--rotary-base": rope["rope_theta"],
        "--vocab-size": str(text["vocab_size"]),
        "--linear-attention-freq": str(interval),
        "--linear-conv-kernel-dim": str(text["linear_conv_kernel_dim"]),
        "--linear-key-head-dim": str(text["linear_key_head_dim"]),
        "--linear-value-head-dim": str(text["linear_value_head_dim"]),
        "--linear-num-key-heads": str(text["linear_num_key_heads"]),
        "--linear-num-value-heads": str(text["linear_num_value_heads"]),
        "--norm-epsilon": text["rms_norm_eps"],
        "--untie-embeddings-and-output-weights": True,
        "--swiglu": True,
        "--disable-bias-linear": True,
        "--qk-layernorm": True,
        "--attention-output-gate": True,
        "--normalization": "RMSNorm",
        "--apply-layernorm-1p": True,
        "--position-embedding-type": "rope",
        "--moe-router-score-function": "softmax",
    }


def assert_flags_match(args: dict[str, str | bool], expected: dict[str, str | bool]) -> None:
    for flag, want in expected.items():
        assert flag in args, f"{flag} missing"
        got = args[flag]
        if isinstance(want, float):  # numbers that bash spells freely (1e-6, 10000000, 0.25)
            assert float(got) == want, f"{flag}: {got} != {want}"
        else:
            assert got == want, f"{flag}: {got!r} != {want!r}"


def test_35b_a3b_matches_transformers_defaults():
    from transformers import Qwen3_5MoeConfig

    text = Qwen3_5MoeConfig().text_config.to_dict()
    # Known difference: transformers' default rope_theta is 1e4, the released Qwen3.5-35B-A3B uses 1e7.
    assert text["rope_parameters"]["rope_theta"] == 1e4
    text["rope_parameters"]["rope_theta"] = 1e7
    args = model_args(MODELS / "qwen3.5-35B-A3B.sh")
    assert_flags_match(args, expected_flags(text))
    assert float(args["--rotary-base"]) == 1e7
    assert args["--moe-aux-loss-coeff"] == "0"


def test_tiny_matches_built_config(tiny_ckpt):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    args = model_args(MODELS / "qwen3.5-tiny.sh")
    assert_flags_match(args, expected_flags(text))
    assert args["--linear-attention-freq"] == str(text["full_attention_interval"])
    assert args["--max-position-embeddings"] == str(text["max_position_embeddings"])


def test_model_args_helper_rejects_repeated_flags(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text("MODEL_ARGS=(--num-layers 2 --swiglu --num-layers 3)\n")
    with pytest.raises(ValueError, match="--num-layers is given twice"):
        model_args(script)

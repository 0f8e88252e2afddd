"""scripts/models/qwen3.5-*.sh against the HF configs they describe, field by field.

The expected flags are derived here from an HF text config (transformers' Qwen3_5MoeConfig()
defaults for 35B-A3B, the built config.json for the tiny model), independently of the .sh files.
"""

from __future__ import annotations

import dataclasses
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


# ---------------------------------------------------------------------------------------------
# Every MODEL_ARGS flag says something true about the checkpoint, or is refused (slime.checkpoints.model_args)

RUN_FLAGS = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
             "--rollout-max-response-len", "16", "--rollout-backend", "transformers", "--train-backend", "fsdp",
             "--colocate"]  # fmt: skip
"""A small run that parses on any machine (the transformers engine and the FSDP backend are built)."""


def sourced_model_args(script: Path) -> list[str]:
    """``MODEL_ARGS`` of a model file exactly as the launcher passes them (repeated flags kept: the last wins)."""
    out = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\0" "${MODEL_ARGS[@]}"', "bash", str(script)],
                         check=True, capture_output=True)
    return out.stdout.decode().split("\0")[:-1]


def refusal(argv: list[str], capsys) -> str:
    """The ``error:`` line of a command line that ``parse_args`` must refuse with exit status 2."""
    from slime.arguments import parse_args

    with pytest.raises(SystemExit) as excinfo:
        parse_args(argv)
    assert excinfo.value.code == 2
    return capsys.readouterr().err


def edited(argv: list[str], flag: str, value: str | list[str] | None) -> list[str]:
    """``argv`` with ``flag`` replaced by ``flag value...``, dropped (``None``), or appended when absent."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        j = i + 1
        while j < len(out) and not out[j].startswith("--"):
            j += 1
        del out[i:j]
    if value is not None:
        out += [flag] + ([] if value == "" else [value] if isinstance(value, str) else list(value))
    return out


def wrong_values(text: dict) -> dict[str, tuple[str | list[str] | None, str]]:
    """For every MODEL_ARGS flag: (a wrong value for the tiny checkpoint, ``None`` = leave the switch out;
    the part of the error that must name it), derived from the checkpoint's ``text_config`` by hand."""
    qwen = "vs the Qwen3.5-MoE model (text_config.model_type 'qwen3_5_moe_text')"
    numbers = {  # flag -> text_config field (the mapping of the module docstring, written out again)
        "--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
        "--ffn-hidden-size": "moe_intermediate_size",  # Qwen3.5-MoE has no dense MLP: the expert width
        "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_key_value_heads",
        "--kv-channels": "head_dim", "--num-experts": "num_experts", "--moe-router-topk": "num_experts_per_tok",
        "--moe-ffn-hidden-size": "moe_intermediate_size",
        "--moe-shared-expert-intermediate-size": "shared_expert_intermediate_size",
        "--vocab-size": "vocab_size", "--norm-epsilon": "rms_norm_eps",
        "--max-position-embeddings": "max_position_embeddings",
        "--linear-conv-kernel-dim": "linear_conv_kernel_dim", "--linear-key-head-dim": "linear_key_head_dim",
        "--linear-value-head-dim": "linear_value_head_dim", "--linear-num-key-heads": "linear_num_key_heads",
        "--linear-num-value-heads": "linear_num_value_heads",
        "--rotary-percent": "rope_parameters.partial_rotary_factor", "--rotary-base": "rope_parameters.rope_theta",
    }  # fmt: skip
    wrong: dict[str, tuple[str | list[str] | None, str]] = {}
    for flag, field in numbers.items():
        good = text
        for key in field.split("."):
            good = good[key]
        bad = 2 * good  # twice the checkpoint's: keeps heads divisible by KV heads, top-k <= experts, rotary <= 1
        bad = int(bad) if flag == "--rotary-base" else bad
        wrong[flag] = (str(bad), f"{flag} {bad} vs text_config.{field} {good}")
    layers = text["num_hidden_layers"]
    linear = [int(kind == "linear_attention") for kind in text["layer_types"]]
    every_2nd_full = [int((i + 1) % 2 != 0) for i in range(layers)]  # Megatron: layer i full when (i + 1) % N == 0
    every_2nd_moe = [int(i % 2 == 0) for i in range(layers)]  # Megatron: layer i MoE when i % N == 0
    wrong["--linear-attention-freq"] = (
        "2", f"--linear-attention-freq 2 = {every_2nd_full} vs text_config.layer_types {linear} (1 = linear_attention)")
    wrong["--moe-layer-freq"] = ("2", f"--moe-layer-freq 2 = {every_2nd_moe} {qwen}: every layer MoE")
    wrong["--moe-aux-loss-coeff"] = ("0.01", "--moe-aux-loss-coeff 0.01 vs the trainers: no load-balancing loss")
    wrong["--untie-embeddings-and-output-weights"] = (
        None, "--untie-embeddings-and-output-weights not given (tied) vs text_config.tie_word_embeddings false")
    wrong["--group-query-attention"] = (
        None, "--group-query-attention not given (off) vs text_config.num_key_value_heads "
        f"{text['num_key_value_heads']} (num_attention_heads {text['num_attention_heads']})")
    wrong["--swiglu"] = (None, f"--swiglu not given (off) vs text_config.hidden_act '{text['hidden_act']}'")
    wrong["--disable-bias-linear"] = (
        None, f"--disable-bias-linear not given (off) vs text_config.attention_bias {text['attention_bias']}")
    for flag in ("--qk-layernorm", "--apply-layernorm-1p", "--attention-output-gate", "--moe-shared-expert-gate"):
        wrong[flag] = (None, f"{flag} not given (off) {qwen}")
    # upstream's alias of --attention-output-gate: on a Qwen3.5-MoE checkpoint both are true, so leaving both out
    # is its wrong value (test_use_gated_attention_is_the_output_gate covers the alias given alone)
    wrong["--use-gated-attention"] = (None, f"--attention-output-gate not given (off) {qwen}")
    wrong["--normalization"] = ("LayerNorm", f"--normalization LayerNorm {qwen}: RMSNorm")
    wrong["--position-embedding-type"] = ("learned_absolute", f"--position-embedding-type learned_absolute {qwen}")
    wrong["--moe-router-score-function"] = ("sigmoid", f"--moe-router-score-function sigmoid {qwen}")
    refused = {"--spec": ["my.module", "my_spec"], "--moe-grouped-gemm": "", "--moe-permute-fusion": "",
               "--moe-token-drop-policy": "probs", "--moe-router-dtype": "fp32"}  # fmt: skip
    for flag, value in refused.items():
        shown = " ".join([flag] + ([value] if isinstance(value, str) and value else list(value) if value else []))
        wrong[flag] = (value, f"read by nothing, so they could only say something false; drop them: {shown} (")
    return wrong


def model_flags() -> list[str]:
    """Every flag of the MODEL_ARGS group (``--help``'s), by its dataclass."""
    from slime.checkpoints.model_args import ModelConfig
    from slime.utils.config import flag_name

    return sorted(flag_name(field) for field in dataclasses.fields(ModelConfig))


def test_every_model_flag_has_a_wrong_value_in_the_test(tiny_ckpt):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    assert sorted(wrong_values(text)) == model_flags()


@pytest.mark.parametrize("flag", model_flags())
def test_each_model_flag_with_a_wrong_value_is_refused_naming_it(flag, tiny_ckpt, capsys):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    value, expected = wrong_values(text)[flag]
    argv = edited(sourced_model_args(MODELS / "qwen3.5-tiny.sh"), flag, value)
    if flag == "--use-gated-attention":
        argv = edited(argv, "--attention-output-gate", None)
    err = refusal(argv + ["--hf-checkpoint", str(tiny_ckpt)] + RUN_FLAGS, capsys)
    assert expected in err, err
    # that flag alone: one mismatch, or (a flag read by nothing) no mismatch at all
    assert err.count(" vs ") == (0 if "read by nothing" in expected else 1), err


def test_use_gated_attention_is_the_output_gate(tiny_ckpt):
    from slime.arguments import parse_args

    argv = edited(sourced_model_args(MODELS / "qwen3.5-tiny.sh"), "--attention-output-gate", None)
    cfg = parse_args(edited(argv, "--use-gated-attention", "") + ["--hf-checkpoint", str(tiny_ckpt)] + RUN_FLAGS)
    assert cfg.model.use_gated_attention and not cfg.model.attention_output_gate


@pytest.mark.parametrize(
    "flag, value",
    [("--qk-layernorm", ""), ("--apply-layernorm-1p", ""), ("--attention-output-gate", ""),
     ("--use-gated-attention", ""), ("--moe-shared-expert-gate", ""), ("--normalization", "RMSNorm"),
     ("--position-embedding-type", "rope"), ("--moe-router-score-function", "softmax")],
)  # fmt: skip
def test_fixed_architecture_flags_are_refused_for_another_architecture(flag, value, tmp_path, capsys):
    # only a Qwen3.5-MoE config.json fixes these; for another model_type slime cannot tell, so it does not accept them
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    err = refusal(edited([], flag, value) + ["--hf-checkpoint", str(tmp_path)] + RUN_FLAGS, capsys)
    shown = f"{flag} {value}" if value else f"{flag} given"
    assert f"{shown} vs model_type 'llama' (only a Qwen3.5-MoE config.json's is known)" in err, err


def test_attention_softmax_in_fp32_is_refused_with_what_decides_it(tiny_ckpt):
    from slime.arguments import parse_args
    from slime.backends.megatron.config import MegatronConfig
    from slime.checkpoints.model_args import check_model_args
    from slime.utils.config import ConfigError

    model = parse_args(sourced_model_args(MODELS / "qwen3.5-tiny.sh") + ["--hf-checkpoint", str(tiny_ckpt)]
                       + RUN_FLAGS).model
    check_model_args(model, str(tiny_ckpt), attention_softmax_in_fp32=MegatronConfig().attention_softmax_in_fp32)
    with pytest.raises(ConfigError, match=r"--attention-softmax-in-fp32 \(the attention kernels of --attention-"):
        check_model_args(model, str(tiny_ckpt), attention_softmax_in_fp32=True)


def qwen35_35b_config() -> dict:
    """Qwen3.5-35B-A3B's config.json: transformers' defaults with the released rope_theta and context length."""
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig().to_dict()
    config["text_config"]["rope_parameters"]["rope_theta"] = 1e7
    config["text_config"]["max_position_embeddings"] = 262144
    return config


def qwen35_35b_scaled_config() -> dict:
    """The scaled checkpoint (the file's header): 35B-A3B's widths, 4 layers (every 4th full attention), 128 experts."""
    config = qwen35_35b_config()
    text = config["text_config"]
    text.update(num_hidden_layers=4, num_experts=128, max_position_embeddings=8192,
                layer_types=["linear_attention"] * 3 + ["full_attention"])
    return config


CHECKPOINTS = {
    "qwen3.5-35B-A3B.sh": qwen35_35b_config,
    "qwen3.5-35B-A3B-scaled.sh": qwen35_35b_scaled_config,
    "qwen3.5-tiny.sh": None,  # the built tiny checkpoint
}


@pytest.mark.parametrize("script", sorted(p.name for p in MODELS.glob("*.sh")))
def test_every_model_file_parses_against_the_checkpoint_it_describes(script, tiny_ckpt, tmp_path):
    from slime.arguments import parse_args

    assert script in CHECKPOINTS, f"scripts/models/{script}: add the checkpoint it describes to CHECKPOINTS"
    ckpt = tiny_ckpt
    if CHECKPOINTS[script] is not None:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(CHECKPOINTS[script]()))
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    cfg = parse_args(sourced_model_args(MODELS / script) + ["--hf-checkpoint", str(ckpt)] + RUN_FLAGS)
    assert (cfg.model.num_layers, cfg.model.num_experts) == (text["num_hidden_layers"], text["num_experts"])

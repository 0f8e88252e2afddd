"""The command line: grouping, the upstream launcher's flags, pass-through SGLang flags, and every
parse-time check (each bad input exits with code 2 and a message naming the flag and the fix).

Upstream's command lines select the Megatron backend and SGLang engines, which are declared but
not in this version, so ``parse_args`` would stop at its last check (``tests/test_registry.py``
tests that refusal).  The autouse fixture below declares both built and installed, so that
every test here reaches the end of ``parse_args`` and tests the flags themselves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from slime.arguments import GROUPS, build_parser, config_to_argv, parse_args, validate
from slime.backends.registry import TRAIN_BACKENDS
from slime.grpo.config import ADVANTAGE_ESTIMATORS
from slime.rollout.engines.sglang.flags import SGLangConfig, extract_sglang_args
from slime.rollout.engines import ENGINES
from slime.utils.config import ConfigError, flag_name

ROOT = Path(__file__).resolve().parents[1]
MODEL_SCRIPT = ROOT / "scripts" / "models" / "qwen3.5-35B-A3B.sh"
TINY_MODEL_SCRIPT = ROOT / "scripts" / "models" / "qwen3.5-tiny.sh"

# MODEL_ARGS of Qwen3.5-35B-A3B as upstream's scripts/models/qwen3.5-35B-A3B.sh passes them
# (40 layers, all MoE; every 4th layer full attention, the others Gated DeltaNet).
QWEN35_35B_A3B_MODEL_ARGS = [
    "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec",
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention",
    "--num-attention-heads", "16", "--num-query-groups", "2", "--kv-channels", "256",
    "--num-layers", "40", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "248320", "--rotary-base", "10000000",
    "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "512",
    "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-layer-freq", "[" + ", ".join(["1"] * 40) + "]",
    "--num-experts", "256", "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32",
    "--moe-permute-fusion", "--moe-aux-loss-coeff", "0",
    "--attention-output-gate", "--moe-shared-expert-gate", "--linear-attention-freq", "4",
    "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "128", "--linear-value-head-dim", "128",
    "--linear-num-key-heads", "16", "--linear-num-value-heads", "32",
]  # fmt: skip

# The rest of the command line of upstream's examples/geo3k_vlm launcher (8 GPUs, colocated).
UPSTREAM_ARGS = shlex.split(
    """--hf-checkpoint X --load X --prompt-data P --input-key problem --label-key answer --apply-chat-template
    --rollout-shuffle --rm-type math --num-rollout 3000 --rollout-batch-size 64 --n-samples-per-prompt 8
    --rollout-max-response-len 4096 --rollout-temperature 0.8 --global-batch-size 512
    --multimodal-keys '{"image": "images"}' --eval-interval 20 --eval-prompt-data geo3k_imgurl T
    --n-samples-per-eval-prompt 1 --eval-max-response-len 4096 --advantage-estimator grpo --kl-loss-coef 0.00
    --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
    --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
    --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-ep-size 8
    --sglang-cuda-graph-bs 1 2 4 8 16 --sglang-max-running-requests 512 --sglang-disable-custom-all-reduce
    --use-wandb --wandb-project slime-geo3k-vlm --wandb-group g --wandb-key k --disable-wandb-random-suffix
    --train-backend megatron --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
    --context-parallel-size 1 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --attention-dropout 0.0
    --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash
    --micro-batch-size 1 --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate"""
)

# A small valid run: 4 prompts x 2 samples per step on one colocated GPU; the checkpoint is not on disk.
BASE = shlex.split(
    "--hf-checkpoint not-on-disk/ckpt --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--rollout-max-response-len 64 --colocate"
)


@pytest.fixture(autouse=True)
def planned_backends_installed(monkeypatch):
    """Declare ``--train-backend megatron`` and ``--rollout-backend sglang`` built, with nothing to install
    (their targets are never imported here: parsing only asks whether they can run)."""
    for registry, name in ((TRAIN_BACKENDS, "megatron"), (ENGINES, "sglang")):
        entry = dataclasses.replace(registry.builtins[name], target=f"{__name__}:not_imported", requires=())
        monkeypatch.setitem(registry.builtins, name, entry)


def with_flags(*extra: str, base: list[str] = BASE) -> list[str]:
    """``base`` with ``extra`` flags; a flag given in both takes ``extra``'s value (flags here take one value)."""
    argv = list(base)
    extra_list = list(extra)
    for token in extra_list:
        if token.startswith("--") and token in argv:
            j = argv.index(token)
            takes_value = j + 1 < len(argv) and not argv[j + 1].startswith("--")
            del argv[j : j + 1 + takes_value]
    return argv + extra_list


def parse_error(argv: list[str], capsys) -> str:
    """The stderr of a command line that must be refused with argparse's exit code 2."""
    with pytest.raises(SystemExit) as excinfo:
        parse_args(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    return err


def model_args_from_script(script: Path = MODEL_SCRIPT) -> list[str]:
    """MODEL_ARGS of a scripts/models/*.sh file (default: qwen3.5-35B-A3B.sh), read by sourcing it with bash."""
    out = subprocess.run(
        ["bash", "-c", 'source "$1" && printf "%s\\0" "${MODEL_ARGS[@]}"', "bash", str(script)],
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().split("\0")[:-1]


# ---------------------------------------------------------------------------------------------
# Parsing the upstream command line


def test_minimal_command_fills_defaults():
    cfg = parse_args(BASE)
    assert cfg.train.global_batch_size == 4 * 2  # one optimizer step per rollout
    assert cfg.cluster.rollout_num_gpus == cfg.cluster.actor_num_gpus == 1  # --colocate shares the trainer GPU
    assert cfg.model.num_layers is None and not cfg.model.is_hybrid_gdn  # MODEL_ARGS come from the checkpoint
    assert cfg.rollout.rollout_backend == "sglang" and cfg.train.train_backend == "megatron"
    assert cfg.sglang.server_args == {}
    assert cfg.eval.eval_prompt_pairs == []


def test_upstream_geo3k_command_line_lands_in_the_right_groups():
    cfg = parse_args(QWEN35_35B_A3B_MODEL_ARGS + UPSTREAM_ARGS)

    m = cfg.model
    assert m.spec == ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size) == (40, 2048, 5632, 248320)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (16, 2, 256)
    assert m.group_query_attention and m.use_gated_attention and m.attention_output_gate and m.qk_layernorm
    assert (m.normalization, m.position_embedding_type, m.norm_epsilon) == ("RMSNorm", "rope", 1e-6)
    assert (m.rotary_percent, m.rotary_base) == (0.25, 10_000_000)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (256, 8, 512)
    assert m.moe_router_score_function == "softmax"
    assert m.moe_router_dtype == "fp32"
    assert m.moe_aux_loss_coeff == 0 and m.moe_shared_expert_gate and m.moe_grouped_gemm and m.moe_permute_fusion
    assert m.moe_layer_pattern == [1] * 40
    assert m.linear_attention_pattern == [0 if i % 4 == 3 else 1 for i in range(40)]  # 30 GDN + 10 full attention
    assert m.is_hybrid_gdn
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim) == (16, 32, 128)

    assert (cfg.checkpoint.hf_checkpoint, cfg.checkpoint.load) == ("X", "X")
    d = cfg.data
    assert (d.prompt_data, d.input_key, d.label_key) == ("P", "problem", "answer")
    assert d.multimodal_keys == {"image": "images"} and d.apply_chat_template and d.rollout_shuffle
    r = cfg.rollout
    assert (r.num_rollout, r.rollout_batch_size, r.n_samples_per_prompt) == (3000, 64, 8)
    assert (r.rollout_max_response_len, r.rollout_temperature) == (4096, 0.8)
    assert cfg.reward.rm_type == "math"
    e = cfg.eval
    assert e.eval_interval == 20 and e.eval_prompt_pairs == [("geo3k_imgurl", "T")]
    assert (e.n_samples_per_eval_prompt, e.eval_max_response_len) == (1, 4096)
    g = cfg.grpo
    assert (g.advantage_estimator, g.kl_loss_type, g.kl_loss_coef, g.kl_coef) == ("grpo", "low_var_kl", 0.0, 0.0)
    assert (g.eps_clip, g.eps_clip_high, g.entropy_coef) == (0.2, 0.28, 0.0) and not g.needs_ref_model
    o = cfg.optimizer
    assert (o.optimizer, o.lr, o.lr_decay_style, o.weight_decay) == ("adam", 1e-6, "constant", 0.1)
    assert (o.adam_beta1, o.adam_beta2) == (0.9, 0.98)
    assert cfg.sglang.server_args == {
        "mem_fraction_static": "0.7",
        "ep_size": "8",
        "cuda_graph_bs": ["1", "2", "4", "8", "16"],
        "max_running_requests": "512",
        "disable_custom_all_reduce": True,
    }
    w = cfg.wandb
    assert w.use_wandb and (w.wandb_project, w.wandb_group, w.wandb_key) == ("slime-geo3k-vlm", "g", "k")
    assert w.disable_wandb_random_suffix
    assert cfg.train.train_backend == "megatron" and cfg.train.global_batch_size == 512
    assert cfg.train.micro_batch_size == 1
    t = cfg.megatron
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size) == (2, 1, 1)
    assert (t.expert_model_parallel_size, t.expert_tensor_parallel_size) == (8, 1) and t.sequence_parallel
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "uniform", 1)
    assert (t.attention_dropout, t.hidden_dropout, t.attention_backend) == (0.0, 0.0, "flash")
    assert t.moe_token_dispatcher_type == "alltoall"  # in upstream's MODEL_ARGS; megatron-core's flag, so its group
    assert t.accumulate_allreduce_grads_in_fp32 and t.attention_softmax_in_fp32
    c = cfg.cluster
    assert (c.actor_num_nodes, c.actor_num_gpus_per_node, c.colocate) == (1, 8, True)
    assert (c.rollout_num_gpus, c.rollout_num_gpus_per_engine, c.num_rollout_engines) == (8, 8, 1)


def test_project_model_script_parses_with_the_upstream_command_line():
    cfg = parse_args(model_args_from_script() + UPSTREAM_ARGS)
    m = cfg.model
    # the released Qwen3.5-35B-A3B text model: 40 layers, every 4th full attention, 256 experts (top 8)
    assert (m.num_layers, m.hidden_size, m.vocab_size) == (40, 2048, 248320)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (16, 2, 256)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == (
        256, 8, 512, 512,
    )  # fmt: skip
    assert m.moe_layer_pattern == [1] * 40
    assert m.linear_attention_pattern == [0 if i % 4 == 3 else 1 for i in range(40)]
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim) == (
        16, 32, 128, 128,
    )  # fmt: skip
    assert m.attention_output_gate or m.use_gated_attention
    assert cfg.megatron.tensor_model_parallel_size == 2 and cfg.sglang.server_args["ep_size"] == "8"


def test_config_to_argv_round_trips_and_redacts():
    cfg = parse_args(QWEN35_35B_A3B_MODEL_ARGS + UPSTREAM_ARGS + ["--rollout-stop", "</answer>", "\n\n"])
    argv = config_to_argv(cfg)
    assert parse_args(argv) == cfg
    assert argv[argv.index("--wandb-key") + 1] == "k"
    redacted = config_to_argv(cfg, redact=True)
    assert redacted[redacted.index("--wandb-key") + 1] == "<redacted>" and "k" not in redacted
    minimal = parse_args(BASE)
    assert parse_args(config_to_argv(minimal)) == minimal


# ---------------------------------------------------------------------------------------------
# --help and unknown flags


def test_help_lists_every_flag_under_its_group_title(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps to the terminal width, also at hyphens
    text = build_parser().format_help()
    body = text[text.index("\noptions:") :]  # skip the usage line, which lists every flag too
    starts = [body.index(f"\n{title}:\n") for _, _, title in GROUPS]
    assert starts == sorted(starts), "groups appear in the launcher's order"
    for (attr, cls, _), start, end in zip(GROUPS, starts, starts[1:] + [len(body)]):
        section = body[start:end]
        if cls is SGLangConfig:
            assert "--sglang-mem-fraction-static 0.7" in section
            continue
        for field in dataclasses.fields(cls):
            assert re.search(rf"(^|\s|/){re.escape(flag_name(field))}(\s|,|$)", section, re.M), (attr, field.name)
    for array in ("MODEL_ARGS", "CKPT_ARGS", "ROLLOUT_ARGS", "EVAL_ARGS", "GRPO_ARGS", "OPTIMIZER_ARGS",
                  "SGLANG_ARGS", "WANDB_ARGS", "BACKEND_ARGS", "MISC_ARGS"):  # fmt: skip
        assert f"\n{array}" in body


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as excinfo:
        parse_args(["--help"])
    assert excinfo.value.code == 0
    assert "BACKEND_ARGS" in capsys.readouterr().out


def test_unknown_flag_is_named_with_the_closest_known_flag(capsys):
    err = parse_error(with_flags("--rollout-temp", "0.8"), capsys)  # abbreviations are refused too
    assert "unrecognized arguments: --rollout-temp 0.8" in err
    assert "did you mean --rollout-temperature?" in err
    err = parse_error(with_flags("--rollout-temprature", "0.8"), capsys)  # misspelt
    assert "did you mean --rollout-temperature?" in err


def test_missing_required_flag_is_named(capsys):
    err = parse_error(BASE[2:], capsys)  # without --hf-checkpoint
    assert "--hf-checkpoint" in err


# ---------------------------------------------------------------------------------------------
# SGLang pass-through


def test_extract_sglang_args_value_forms_and_order():
    sglang, rest = extract_sglang_args(
        ["--lr", "1e-6", "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4",
         "--sglang-disable-custom-all-reduce", "--colocate", "--sglang-chunked-prefill-size", "-1",
         "--sglang-attention-backend=triton"]
    )  # fmt: skip
    assert rest == ["--lr", "1e-6", "--colocate"]
    assert sglang.server_args == {
        "mem_fraction_static": "0.7",
        "cuda_graph_bs": ["1", "2", "4"],
        "disable_custom_all_reduce": True,
        "chunked_prefill_size": "-1",
        "attention_backend": "triton",
    }
    assert sglang.server_argv() == [
        "--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2", "4", "--disable-custom-all-reduce",
        "--chunked-prefill-size=-1", "--attention-backend", "triton",
    ]  # fmt: skip


def test_a_value_that_starts_with_a_dash_reaches_sglangs_parser_and_command_sh_whole():
    """``--sglang-chat-template=-x`` is one value; as ``--chat-template -x`` argparse would read ``-x`` as a flag."""
    import argparse

    sglang, _ = extract_sglang_args(["--sglang-chat-template=-my", "--sglang-weight-decay=-1e-3",
                                     "--sglang-cuda-graph-bs", "1", "2"])  # fmt: skip
    assert sglang.server_args == {"chat_template": "-my", "weight_decay": "-1e-3", "cuda_graph_bs": ["1", "2"]}
    server = argparse.ArgumentParser()  # argparse, as SGLang's ServerArgs.add_cli_args uses it
    server.add_argument("--chat-template")
    server.add_argument("--weight-decay", type=float)
    server.add_argument("--cuda-graph-bs", type=int, nargs="+")
    parsed = server.parse_args(sglang.server_argv())
    assert (parsed.chat_template, parsed.weight_decay, parsed.cuda_graph_bs) == ("-my", -0.001, [1, 2])
    again, rest = extract_sglang_args(sglang.to_argv())  # command.sh read back
    assert rest == [] and again == sglang


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--sglang-tp-size", "2"], "--rollout-num-gpus-per-engine"),
        (["--sglang-model-path", "m"], "--hf-checkpoint"),
        (["--sglang-tensor-parallel-size", "2"], "--rollout-num-gpus-per-engine"),  # SGLang's alias of --tp-size
        (["--sglang-tp", "2"], "--sglang-tp (SGLang's parser reads it as --tp-size) is set by slime"),
        (["--sglang-random-se", "3"], "--rollout-seed"),
        (["--sglang-ep-size", "8", "--sglang-ep-size", "4"], "--sglang-ep-size is given twice"),
        (["--sglang-", "1"], "not a valid SGLang flag"),
        (["--sglang-Mem_Fraction", "1"], "not a valid SGLang flag"),
    ],
)
def test_bad_sglang_flags_are_refused(argv, fragment, capsys):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        extract_sglang_args(argv)
    assert fragment in parse_error(BASE + argv, capsys)


def test_sglang_flags_with_the_transformers_engine_are_refused(capsys):
    err = parse_error(with_flags("--rollout-backend", "transformers", "--sglang-mem-fraction-static", "0.7"), capsys)
    assert "--sglang-mem-fraction-static would be ignored; remove it or use --rollout-backend sglang" in err
    err = parse_error(with_flags("--rollout-backend", "transformers", "--sglang-dtype=float16",
                                 "--sglang-disable-cuda-graph"), capsys)
    assert "--sglang-dtype --sglang-disable-cuda-graph would be ignored; remove them or" in err


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet batching


def write_hf_config(folder: Path, config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


GDN_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


@pytest.mark.parametrize(
    "bad_batching",
    [["--micro-batch-size", "2"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]],
)
@pytest.mark.parametrize("source", ["model_args", "text_config", "top_level"])
def test_gdn_model_refuses_packed_micro_batches_where_parity_is_unproven(source, bad_batching, tmp_path, capsys):
    # Megatron at TP 2 (2 GPUs): packed == one sequence at a time is proven at TP = PP = CP = EP = 1 only.
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--actor-num-gpus-per-node", "2"]
    if source == "model_args":
        argv = with_flags("--num-layers", "4", "--linear-attention-freq", "4", *tp2)
    else:
        config = {"layer_types": GDN_LAYERS}
        if source == "text_config":
            config = {"text_config": config}
        argv = with_flags("--hf-checkpoint", write_hf_config(tmp_path / "ckpt", config), *tp2)
    parse_args(argv)  # micro-batch size 1 is fine
    err = parse_error(argv + bad_batching, capsys)
    assert "Gated-DeltaNet" in err and "--tensor-model-parallel-size 2" in err
    assert "proven equal to one sequence at a time only at TP = PP = CP = EP = 1" in err
    assert "use --micro-batch-size 1 and remove --use-dynamic-batch-size" in err
    got = "got --micro-batch-size 2" if bad_batching[0] == "--micro-batch-size" else "got --use-dynamic-batch-size"
    assert got in err
    assert ("config.json" in err) == (source != "model_args")


@pytest.mark.parametrize(
    "bad_batching",
    [["--micro-batch-size", "2"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]],
)
def test_gdn_model_packs_micro_batches_where_parity_is_proven(bad_batching):
    # Megatron at TP = PP = CP = EP = 1 (any DP): packed micro-batches are allowed.
    for gpus in ("1", "2"):
        cfg = parse_args(with_flags("--num-layers", "4", "--linear-attention-freq", "4",
                                    "--actor-num-gpus-per-node", gpus, *bad_batching))
        assert cfg.train.use_dynamic_batch_size == ("--use-dynamic-batch-size" in bad_batching)


def test_fsdp_keeps_upstreams_gdn_limit(capsys):
    err = parse_error(with_flags("--train-backend", "fsdp", "--num-layers", "4", "--linear-attention-freq", "4",
                                 "--micro-batch-size", "2"), capsys)
    assert "Gated-DeltaNet" in err and "upstream's limit" in err and "got --micro-batch-size 2" in err


@pytest.mark.parametrize(
    "model_flags, layer_types",
    [([], ["full_attention"] * 4), (["--num-layers", "4", "--linear-attention-freq", "1"], None)],
)
def test_models_without_linear_attention_allow_larger_micro_batches(model_flags, layer_types, tmp_path):
    # without layer_types every layer is full attention; --num-layers 4 must match the checkpoint's count
    text = {"layer_types": layer_types} if layer_types else {"num_hidden_layers": 4}
    ckpt = write_hf_config(tmp_path / "ckpt", {"text_config": text})
    cfg = parse_args(with_flags("--hf-checkpoint", ckpt, "--micro-batch-size", "2", *model_flags))
    assert cfg.train.micro_batch_size == 2 and not cfg.model.is_hybrid_gdn


def test_unreadable_checkpoint_config_is_named(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    err = parse_error(with_flags("--hf-checkpoint", str(folder), "--micro-batch-size", "2"), capsys)
    assert f"--hf-checkpoint {folder}" in err and "config.json" in err


# ---------------------------------------------------------------------------------------------
# Batch sizes and parallel layout


def suggested_batch_size(err: str) -> int:
    return int(re.search(r"e\.g\. --global-batch-size (\d+)", err)[1])


def test_rollout_samples_must_split_into_global_batches(capsys):
    err = parse_error(with_flags("--global-batch-size", "3"), capsys)  # 4 prompts x 2 samples = 8
    assert "--rollout-batch-size 4 * --n-samples-per-prompt 2 = 8 samples" in err
    assert "--global-batch-size 3" in err
    fix = suggested_batch_size(err)
    assert 8 % fix == 0 and fix in (2, 4)  # the divisors of 8 closest to 3


@pytest.mark.parametrize(
    "gpus, tp, mbs, gbs, dp",
    [
        (4, 1, 1, 6, 4),  # 6 samples cannot split over 4 data-parallel ranks
        (4, 2, 2, 6, 2),  # dp = 4 GPUs / TP 2 = 2 ranks, 2 samples each per micro-batch: multiples of 4
    ],
)
def test_global_batch_must_split_over_data_parallel_micro_batches(gpus, tp, mbs, gbs, dp, capsys):
    flags = [
        "--rollout-batch-size", "6", "--n-samples-per-prompt", "4",
        "--actor-num-gpus-per-node", str(gpus), "--tensor-model-parallel-size", str(tp), "--micro-batch-size", str(mbs),
        *(["--sequence-parallel"] if tp > 1 else []),
    ]  # fmt: skip
    err = parse_error(with_flags(*flags, "--global-batch-size", str(gbs)), capsys)
    assert f"data-parallel size {dp}" in err and f"= {dp * mbs};" in err
    fix = suggested_batch_size(err)
    assert 24 % fix == 0 and fix % (dp * mbs) == 0  # 6 prompts x 4 samples = 24
    assert parse_args(with_flags(*flags, "--global-batch-size", str(fix))).train.global_batch_size == fix


def test_dynamic_batch_size_ignores_micro_batch_size():
    flags = ["--actor-num-gpus-per-node", "2", "--global-batch-size", "2", "--micro-batch-size", "4"]
    cfg = parse_args(with_flags(*flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1000"))
    assert cfg.train.global_batch_size == 2
    with pytest.raises(SystemExit):
        parse_args(with_flags(*flags))  # 2 samples cannot fill 2 ranks x 4 samples


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "3"], ["4 GPUs", "= 3"]),
        (["--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "4"],
         ["--context-parallel-size 4 = 8"]),
        # TP*PP*CP = 4 divides 8, but the expert layout ETP(=TP 2) * EP 8 * PP 1 = 16 does not
        (["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
          "--expert-model-parallel-size", "8", "--sequence-parallel"], ["--expert-tensor-parallel-size 2", "= 16"]),
        (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--expert-tensor-parallel-size", "1"], ["needs --sequence-parallel"]),
        (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2", "--num-experts", "3"],
         ["--num-experts 3", "--expert-model-parallel-size 2"]),
        (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
          "--sequence-parallel"], ["--num-attention-heads 3"]),
        # megatron-core's MoE layer refuses to train with TP > 1 and no sequence parallelism (at the first step)
        (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"],
         ["--tensor-model-parallel-size 2 needs --sequence-parallel", "MoE layer"]),
    ],
)  # fmt: skip
def test_parallel_sizes_must_fit_the_trainer_gpus(flags, fragments, capsys):
    err = parse_error(with_flags(*flags), capsys)
    for fragment in fragments:
        assert fragment in err


def test_expert_layout_that_fits_is_accepted():
    # 8 GPUs: TP 2 x PP 2 x DP 2 for dense layers, ETP 1 x EP 4 x PP 2 for experts (8 % (1 * 4 * 2) == 0)
    cfg = parse_args(with_flags(
        "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--sequence-parallel",
        "--rollout-batch-size", "8",
    ))  # fmt: skip
    assert cfg.megatron.expert_tensor_parallel == 1 and cfg.megatron.model_parallel_size == 4


def test_context_parallelism_is_refused_by_the_native_model_at_parse_time(capsys):
    # Megatron's GPU-count rules accept TP 2 x CP 2 on 8 GPUs; the native Qwen3.5 model has no CP yet.
    err = parse_error(with_flags(
        "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
        "--sequence-parallel", "--rollout-batch-size", "8",
    ), capsys)  # fmt: skip
    assert "--context-parallel-size 2: context parallelism is not implemented for the native Qwen3.5 model" in err


@pytest.mark.parametrize(
    "tp, ep, fragment",
    [
        # Qwen3.5-35B-A3B: 2 KV heads, 16 Gated DeltaNet key heads, 16 query heads, 256 experts
        (4, 1, "--tensor-model-parallel-size 4 must divide {kv_heads} 2"),
        (32, 1, "--tensor-model-parallel-size 32 must divide {gdn_key_heads} 16"),  # Gated DeltaNet: sharded by heads
        (1, 3, "--expert-model-parallel-size 3 must divide {experts} 256"),
    ],
)
def test_megatron_layout_is_checked_against_the_model_sizes(tmp_path, tp, ep, fragment, capsys):
    """The native model's rules (heads, GDN key heads, experts), at parse time, on the sizes of MODEL_ARGS
    before the checkpoint exists, and of its config.json once it does."""
    from transformers import Qwen3_5MoeConfig

    gpus = str(tp * ep * 2)  # TP * EP divides the GPUs; the model's sizes are what fails
    layout = ["--actor-num-gpus-per-node", gpus, "--tensor-model-parallel-size", str(tp),
              "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "1", "--sequence-parallel",
              "--rollout-batch-size", "64"]  # fmt: skip
    err = parse_error(with_flags(*QWEN35_35B_A3B_MODEL_ARGS, *layout), capsys)
    assert fragment.format(kv_heads="--num-query-groups", gdn_key_heads="--linear-num-key-heads",
                           experts="--num-experts") in err, err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(Qwen3_5MoeConfig().to_dict()))  # the 35B-A3B defaults
    err = parse_error(with_flags(*layout, "--hf-checkpoint", str(ckpt)), capsys)
    assert fragment.format(kv_heads="num_key_value_heads", gdn_key_heads="linear_num_key_heads",
                           experts="num_experts") in err, err
    assert f"of --hf-checkpoint {ckpt}/config.json" in err


def test_a_layout_the_model_can_shard_is_accepted_with_its_config():
    from transformers import Qwen3_5MoeConfig

    cfg = parse_args(with_flags(*QWEN35_35B_A3B_MODEL_ARGS, "--actor-num-gpus-per-node", "8",
                                "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8",
                                "--expert-tensor-parallel-size", "1", "--sequence-parallel", "--rollout-batch-size", "8"))
    assert Qwen3_5MoeConfig().text_config.num_key_value_heads % cfg.megatron.tensor_model_parallel_size == 0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--qkv-format", "bshd"], "--qkv-format bshd (micro-batches are packed THD sequences)"),
        (["--attention-backend", "fused"], "--attention-backend fused (TransformerEngine's fused attention"),
        (["--attention-dropout", "0.1"], "--attention-dropout 0.1 (the gated attention has no dropout)"),
        (["--megatron-to-hf-mode", "bridge"], "--megatron-to-hf-mode bridge (Megatron-Bridge is not supported"),
        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex (DeepEP / HybridEP are not"),
    ],
)  # fmt: skip
def test_megatron_refuses_what_the_native_model_does_not_do(flags, named, capsys):
    err = parse_error(with_flags(*flags), capsys)
    assert "--train-backend megatron does not implement" in err and named in err


def test_the_token_dispatcher_is_the_flag_else_allgather_with_every_expert_local_or_on_cpu():
    """``--moe-token-dispatcher-type`` reaches megatron-core's config as given; unset, the backend takes allgather
    where each rank holds every expert whole (EP = ETP = 1) and on the CPU, alltoall on CUDA with EP > 1 or
    ETP > 1; alltoall on the CPU is refused naming the flag (its counts go by CUDA stream)."""
    cuda, cpu = dict(cuda=True), dict(cuda=False)
    default = parse_args(with_flags()).megatron
    assert (default.token_dispatcher(**cuda), default.token_dispatcher(**cpu)) == ("allgather", "allgather")
    eight = ("--actor-num-gpus-per-node", "8", "--rollout-batch-size", "8")
    ep = parse_args(with_flags(*eight, "--expert-model-parallel-size", "8")).megatron
    etp = parse_args(with_flags(*eight, "--tensor-model-parallel-size", "2", "--sequence-parallel")).megatron
    assert (ep.token_dispatcher(**cuda), etp.token_dispatcher(**cuda)) == ("alltoall", "alltoall")  # ETP = TP = 2
    chosen = parse_args(with_flags("--moe-token-dispatcher-type", "allgather")).megatron
    assert (chosen.token_dispatcher(**cuda), chosen.token_dispatcher(**cpu)) == ("allgather", "allgather")
    alltoall = parse_args(with_flags("--moe-token-dispatcher-type", "alltoall")).megatron
    assert alltoall.token_dispatcher(**cuda) == "alltoall"
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type alltoall needs CUDA"):
        alltoall.token_dispatcher(**cpu)


def test_save_hf_needs_save(capsys):
    assert "--save-hf out/hf is written with each checkpoint" in parse_error(with_flags("--save-hf", "out/hf"), capsys)
    cfg = parse_args(with_flags("--save-hf", "out/hf_{rollout_id}", "--save", "out/ckpt"))
    assert cfg.megatron.save_hf == "out/hf_{rollout_id}"


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--rollout-num-gpus", "2"], "--rollout-num-gpus must equal"),  # colocated with 1 trainer GPU
        (["--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "4"], "not a multiple of --rollout-num-gpus-per"),
    ],
)
def test_rollout_gpu_counts(flags, fragment, capsys):
    colocate = "--rollout-num-gpus-per-engine" not in flags
    argv = with_flags(*flags) if colocate else [t for t in with_flags(*flags) if t != "--colocate"]
    assert fragment in parse_error(argv, capsys)


def test_rollout_gpus_required_without_colocate(capsys):
    no_colocate = [t for t in BASE if t != "--colocate"]
    assert "--rollout-num-gpus is required without --colocate" in parse_error(no_colocate, capsys)
    cfg = parse_args(no_colocate + ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"])
    assert cfg.cluster.num_gpus_needed == 1 + 2 and cfg.cluster.num_rollout_engines == 1


@pytest.mark.parametrize(
    "colocate, available, fits", [(True, 8, True), (True, 7, False), (False, 12, True), (False, 11, False)]
)
def test_requested_gpus_must_fit_the_cluster(colocate, available, fits):
    # 8 trainer GPUs; without --colocate 4 more for two 2-GPU engines: 12
    flags = ["--actor-num-gpus-per-node", "8", "--rollout-batch-size", "8"]
    if colocate:
        argv = with_flags(*flags)
    else:
        argv = [t for t in with_flags(*flags) if t != "--colocate"]
        argv += ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]
    cfg = parse_args(argv)
    if fits:
        validate(cfg, num_gpus_available=available)
    else:
        with pytest.raises(ConfigError, match=rf"needs {8 if colocate else 12} GPUs .* has {available}"):
            validate(cfg, num_gpus_available=available)


# ---------------------------------------------------------------------------------------------
# Field checks, one bad input each


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--rollout-temperature", "0"], "--rollout-temperature must be > 0, got 0.0"),
        (["--rollout-temperature", "-0.5"], "--rollout-temperature must be > 0, got -0.5"),
        (["--rollout-temperature", "0"], "(greedy evaluation: --eval-temperature 0)"),
        (["--eval-temperature", "-1"], "--eval-temperature must be >= 0, got -1.0; use 0 for greedy decoding"),
        (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1], got 0.0"),
        (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1], got 1.5"),
        (["--eval-top-p", "0"], "--eval-top-p must be in (0, 1]"),
        (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or >= 1"),
        (["--rollout-engine-start-timeout", "0"], "--rollout-engine-start-timeout must be > 0 seconds, got 0.0"),
        (["--rollout-engine-start-timeout", "nan"], "--rollout-engine-start-timeout must be a finite number, got nan"),
        (["--max-prompt-length-mismatch-fraction", "1.5"], "--max-prompt-length-mismatch-fraction must be in [0, 1]"),
        (["--max-prompt-length-mismatch-fraction", "-0.1"], "must be in [0, 1], got -0.1; e.g. 0.1, or 0 to stop"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1, got 0"),
        (["--num-epoch", "1"], "--num-rollout 2 and --num-epoch 1 both given"),
        (["--eval-interval", "5"], "--eval-interval 5 needs datasets to evaluate: add --eval-prompt-data"),
        (["--eval-prompt-data", "geo3k", "a.parquet", "aime"], "NAME PATH pairs, got 3 values"),
        (["--eval-prompt-data", "a", "x", "a", "y"], "names must be unique; repeated: a"),
        (["--save-interval", "10"], "--save-interval 10 needs a folder to save to: add --save"),
        (["--rm-type", "nope"], "--rm-type 'nope'"),
        (["--kl-loss-coef", "0.1"], "--kl-loss-coef 0.1 has no effect without --use-kl-loss"),
        (["--train-backend", "deepspeed"], "--train-backend 'deepspeed' is not valid; use one of fsdp, megatron"),
        (["--rollout-backend", "vllm"], "--rollout-backend 'vllm' is not valid; use one of sglang, transformers"),
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        (["--recompute-granularity", "full"], "needs --recompute-method {uniform,block} and --recompute-num-layers"),
        (["--recompute-method", "uniform"], "have no effect without --recompute-granularity"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "full only"),
        (["--attention-dropout", "1.0"], "--attention-dropout must be in [0, 1), got 1.0"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--min-lr", "1e-3"], "--min-lr must be in [0, --lr"),
        (["--num-layers", "3", "--moe-layer-freq", "[1, 1]"], "--moe-layer-freq lists 2 layers but --num-layers is 3"),
        (["--moe-layer-freq", "[1, 2]"], "one 0 or 1 per layer"),
        (["--linear-attention-freq", "every4"], "--linear-attention-freq must be an integer or a list"),
        (["--num-attention-heads", "16", "--num-query-groups", "3"], "not a multiple of --num-query-groups 3"),
        (["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk 8 exceeds --num-experts 4"),
    ],
)
def test_bad_flag_values_are_refused_with_the_flag_and_fix(flags, fragment, capsys):
    assert fragment in parse_error(with_flags(*flags), capsys)


def test_eval_temperature_zero_is_greedy_evaluation_and_help_says_what_it_ignores(capsys):
    cfg = parse_args(with_flags("--eval-temperature", "0"))
    assert cfg.eval.eval_temperature == 0.0 and cfg.rollout.rollout_temperature > 0
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 = greedy decoding" in text and "--eval-top-p and --rollout-top-k are then ignored" in text


def test_num_rollout_or_num_epoch_is_required(capsys):
    argv = [t for i, t in enumerate(BASE) if t != "--num-rollout" and BASE[i - 1] != "--num-rollout"]
    assert "give --num-rollout N" in parse_error(argv, capsys)
    assert parse_args(argv + ["--num-epoch", "3"]).rollout.num_epoch == 3


def test_unknown_rm_type_lists_the_registered_names(capsys):
    err = parse_error(with_flags("--rm-type", "nope"), capsys)
    for name in ("math", "deepscaler", "geo3k"):
        assert name in err
    custom = "my_rewards.geometry:score"
    assert parse_args(with_flags("--rm-type", custom)).reward.rm_type == custom


def test_kl_flags(caplog):
    cfg = parse_args(with_flags("--use-kl-loss", "--kl-loss-coef", "0.01"))
    assert cfg.grpo.needs_ref_model
    with caplog.at_level(logging.WARNING, logger="slime.arguments"):
        cfg = parse_args(with_flags("--use-kl-loss", "--ref-load", "ref/"))
    assert not cfg.grpo.needs_ref_model
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "--use-kl-loss with --kl-loss-coef 0 adds no KL term" in messages
    assert "--ref-load ref/ is unused" in messages


def test_only_group_relative_estimators_warn_about_groups_of_one(monkeypatch, caplog):
    """The warning follows the mark on the estimator's registry entry, not a list of names."""
    from slime.grpo.config import ADVANTAGE_ESTIMATORS, group_relative

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS._entries, "per_sample", lambda rewards, group_size, cfg: rewards)
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS._entries, "ranked", group_relative(lambda rewards, group_size, cfg: rewards))
    for name, warns in (("per_sample", False), ("ranked", True), ("dr_grpo", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slime.arguments"):
            parse_args(with_flags("--n-samples-per-prompt", "1", "--advantage-estimator", name))
        assert ("every advantage is 0" in caplog.text) is warns, name


def test_grpo_groups_of_one_response_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="slime.arguments"):
        parse_args(with_flags("--n-samples-per-prompt", "1"))
    assert "every advantage is 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime.arguments"):
        parse_args(BASE)  # 2 samples per prompt
    assert "every advantage is 0" not in caplog.text


def test_layer_patterns_follow_megatron():
    cfg = parse_args(with_flags("--num-layers", "8", "--linear-attention-freq", "4", "--moe-layer-freq", "2"))
    # linear attention: layer i is full attention when (i + 1) % 4 == 0; MoE: layer i when i % 2 == 0
    assert cfg.model.linear_attention_pattern == [1, 1, 1, 0, 1, 1, 1, 0]
    assert cfg.model.moe_layer_pattern == [1, 0, 1, 0, 1, 0, 1, 0]
    cfg = parse_args(with_flags("--num-layers", "3", "--linear-attention-freq", "[0, 1, 0]", "--micro-batch-size", "1"))
    assert cfg.model.linear_attention_pattern == [0, 1, 0] and cfg.model.is_hybrid_gdn


# ---------------------------------------------------------------------------------------------
# MODEL_ARGS against the checkpoint's config.json


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced (the flag must be there, with one value)."""
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def test_tiny_model_script_matches_the_tiny_checkpoint(tiny_ckpt):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    cfg = parse_args(model_args_from_script(TINY_MODEL_SCRIPT) + with_flags("--hf-checkpoint", str(tiny_ckpt)))
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (text["num_hidden_layers"], text["hidden_size"])


def test_model_args_that_disagree_with_the_checkpoint_are_listed(tiny_ckpt, capsys):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    argv = replace_flag(model_args_from_script(TINY_MODEL_SCRIPT), "--num-layers", "40")
    argv = replace_flag(argv, "--hidden-size", "2048")
    err = parse_error(argv + with_flags("--hf-checkpoint", str(tiny_ckpt)), capsys)
    assert f"--hf-checkpoint {tiny_ckpt}" in err
    assert f"--num-layers 40 vs text_config.num_hidden_layers {text['num_hidden_layers']}" in err
    assert f"--hidden-size 2048 vs text_config.hidden_size {text['hidden_size']}" in err
    # --linear-attention-freq 4 still fits the checkpoint's layers: only the two flags above are listed
    assert err.count(" vs ") == 2


def test_35b_model_script_matches_the_transformers_config(tmp_path):
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig().to_dict()
    # the released Qwen3.5-35B-A3B differs from transformers' defaults in these two fields
    config["text_config"]["rope_parameters"]["rope_theta"] = 1e7
    config["text_config"]["max_position_embeddings"] = 262144
    ckpt = write_hf_config(tmp_path / "ckpt", config)
    cfg = parse_args(model_args_from_script() + with_flags("--hf-checkpoint", ckpt))
    assert cfg.model.num_layers == 40
    argv = replace_flag(model_args_from_script(), "--rotary-base", "10000")
    with pytest.raises(SystemExit):
        parse_args(argv + with_flags("--hf-checkpoint", ckpt))


# A hand-made Qwen3.5-MoE text config with a distinct value in every field, and the flags that describe it
# (the architecture's switches included: a Qwen3.5-MoE model_type fixes them).
HAND_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 6, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 24,
    "num_experts": 10, "num_experts_per_tok": 3, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 48,
    "rope_parameters": {"rope_theta": 500000.0, "partial_rotary_factor": 0.5}, "vocab_size": 1024,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "linear_conv_kernel_dim": 3, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
    "layer_types": ["linear_attention", "full_attention"] * 3, "tie_word_embeddings": False,
}  # fmt: skip
HAND_MODEL_ARGS = [
    "--num-layers", "6", "--hidden-size", "96", "--num-attention-heads", "6", "--group-query-attention",
    "--num-query-groups", "3", "--kv-channels", "24", "--num-experts", "10", "--moe-router-topk", "3",
    "--moe-ffn-hidden-size", "40", "--moe-shared-expert-intermediate-size", "48", "--rotary-base", "500000",
    "--rotary-percent", "0.5", "--vocab-size", "1024", "--norm-epsilon", "0.00001",  # = 1e-5, spelt differently
    "--max-position-embeddings", "4096", "--linear-conv-kernel-dim", "3", "--linear-key-head-dim", "8",
    "--linear-value-head-dim", "12", "--linear-num-key-heads", "2", "--linear-num-value-heads", "6",
    "--linear-attention-freq", "2", "--untie-embeddings-and-output-weights", "--swiglu", "--disable-bias-linear",
    "--qk-layernorm", "--apply-layernorm-1p", "--attention-output-gate", "--moe-shared-expert-gate",
]  # fmt: skip


def test_hand_made_config_and_its_flags_agree(tmp_path):
    ckpt = write_hf_config(tmp_path / "ckpt", {"model_type": "qwen3_5_moe", "text_config": HAND_TEXT_CONFIG})
    cfg = parse_args(HAND_MODEL_ARGS + with_flags("--hf-checkpoint", ckpt))
    assert cfg.model.linear_attention_pattern == [1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    "flag, bad, expected",
    [
        ("--num-layers", "7", "--num-layers 7 vs text_config.num_hidden_layers 6"),
        ("--hidden-size", "128", "--hidden-size 128 vs text_config.hidden_size 96"),
        ("--num-attention-heads", "12", "--num-attention-heads 12 vs text_config.num_attention_heads 6"),
        ("--num-query-groups", "2", "--num-query-groups 2 vs text_config.num_key_value_heads 3"),
        ("--kv-channels", "32", "--kv-channels 32 vs text_config.head_dim 24"),
        ("--num-experts", "12", "--num-experts 12 vs text_config.num_experts 10"),
        ("--moe-router-topk", "2", "--moe-router-topk 2 vs text_config.num_experts_per_tok 3"),
        ("--moe-ffn-hidden-size", "64", "--moe-ffn-hidden-size 64 vs text_config.moe_intermediate_size 40"),
        ("--moe-shared-expert-intermediate-size", "64",
         "--moe-shared-expert-intermediate-size 64 vs text_config.shared_expert_intermediate_size 48"),
        ("--rotary-percent", "0.25", "--rotary-percent 0.25 vs text_config.rope_parameters.partial_rotary_factor 0.5"),
        ("--rotary-base", "10000", "--rotary-base 10000 vs text_config.rope_parameters.rope_theta 500000.0"),
        ("--vocab-size", "1000", "--vocab-size 1000 vs text_config.vocab_size 1024"),  # no padding tolerance
        ("--norm-epsilon", "1e-6", "--norm-epsilon 1e-06 vs text_config.rms_norm_eps 1e-05"),
        ("--max-position-embeddings", "8192",
         "--max-position-embeddings 8192 vs text_config.max_position_embeddings 4096"),
        ("--linear-conv-kernel-dim", "4", "--linear-conv-kernel-dim 4 vs text_config.linear_conv_kernel_dim 3"),
        ("--linear-key-head-dim", "16", "--linear-key-head-dim 16 vs text_config.linear_key_head_dim 8"),
        ("--linear-value-head-dim", "16", "--linear-value-head-dim 16 vs text_config.linear_value_head_dim 12"),
        ("--linear-num-key-heads", "4", "--linear-num-key-heads 4 vs text_config.linear_num_key_heads 2"),
        ("--linear-num-value-heads", "4", "--linear-num-value-heads 4 vs text_config.linear_num_value_heads 6"),
        # Megatron: layer i (from 0) is full attention when (i + 1) % 3 == 0, i.e. layers 2 and 5
        ("--linear-attention-freq", "3",
         "--linear-attention-freq 3 = [1, 1, 0, 1, 1, 0] vs text_config.layer_types [1, 0, 1, 0, 1, 0]"),
        ("--linear-attention-freq", "[1, 1, 0, 0, 1, 0]",
         "--linear-attention-freq [1, 1, 0, 0, 1, 0] vs text_config.layer_types [1, 0, 1, 0, 1, 0]"),
    ],
)  # fmt: skip
def test_each_model_arg_is_compared_with_its_checkpoint_field(flag, bad, expected, tmp_path, capsys):
    ckpt = write_hf_config(tmp_path / "ckpt", {"text_config": HAND_TEXT_CONFIG})
    err = parse_error(replace_flag(HAND_MODEL_ARGS, flag, bad) + with_flags("--hf-checkpoint", ckpt), capsys)
    assert expected in err and err.count(" vs ") == 1, err


def test_untie_switch_is_compared_with_tie_word_embeddings(tmp_path, capsys):
    ckpt = write_hf_config(tmp_path / "ckpt", {"text_config": HAND_TEXT_CONFIG})
    tied_flags = [t for t in HAND_MODEL_ARGS if t != "--untie-embeddings-and-output-weights"]
    err = parse_error(tied_flags + with_flags("--hf-checkpoint", ckpt), capsys)
    assert "--untie-embeddings-and-output-weights not given (tied) vs text_config.tie_word_embeddings false" in err
    tied = write_hf_config(tmp_path / "tied", {"text_config": {**HAND_TEXT_CONFIG, "tie_word_embeddings": True}})
    err = parse_error(HAND_MODEL_ARGS + with_flags("--hf-checkpoint", tied), capsys)
    assert "--untie-embeddings-and-output-weights given vs text_config.tie_word_embeddings true" in err
    assert parse_args(tied_flags + with_flags("--hf-checkpoint", tied)).model.num_layers == 6


def test_fields_absent_from_the_checkpoint(tmp_path, capsys):
    # a dense, full-attention config at the top level, without head_dim, partial_rotary_factor, layer_types
    dense = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "tie_word_embeddings": True}
    ckpt = write_hf_config(tmp_path / "ckpt", dense)
    # implied by Hugging Face: head_dim = 64 // 4 = 16, rotary fraction 1, every layer full attention
    flags = ["--kv-channels", "16", "--rotary-percent", "1", "--linear-attention-freq", "1"]
    assert parse_args(flags + with_flags("--hf-checkpoint", ckpt)).model.kv_channels == 16
    err = parse_error(["--kv-channels", "32", "--num-experts", "8"] + with_flags("--hf-checkpoint", ckpt), capsys)
    assert "--kv-channels 32 vs head_dim (absent; implied) 16" in err
    assert "--num-experts 8 vs num_experts absent" in err


def test_model_args_are_not_checked_without_a_local_config(tmp_path):
    # a hub name or a folder that does not exist yet: nothing to compare with
    cfg = parse_args(HAND_MODEL_ARGS + with_flags("--hf-checkpoint", "Qwen/Qwen3.5-35B-A3B"))
    assert cfg.model.num_layers == 6
    (tmp_path / "empty").mkdir()
    assert parse_args(HAND_MODEL_ARGS + with_flags("--hf-checkpoint", str(tmp_path / "empty"))).model.num_layers == 6


# ---------------------------------------------------------------------------------------------
# --train-backend fsdp refuses Megatron-only flags at parse time


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size 2"]),  # 1 GPU: still the fsdp error
        (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"],
         ["--pipeline-model-parallel-size 2"]),
        (["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"], ["--context-parallel-size 2"]),
        (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"], ["--expert-model-parallel-size 2"]),
        (["--actor-num-gpus-per-node", "2", "--expert-tensor-parallel-size", "2"], ["--expert-tensor-parallel-size 2"]),
        (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024"], ["--use-dynamic-batch-size ("]),
        (["--megatron-to-hf-mode", "bridge"], ["--megatron-to-hf-mode bridge"]),
        (["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type alltoall"]),
        (["--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"],
         ["--sequence-parallel (", "--recompute-granularity full (use --gradient-checkpointing)"]),
        # Megatron flags that the FSDP backend used to ignore silently
        (["--attention-backend", "flash", "--accumulate-allreduce-grads-in-fp32", "--attention-dropout", "0.1"],
         ["--attention-backend flash (use --attn-implementation)",
          "--accumulate-allreduce-grads-in-fp32 (a flag of --train-backend megatron)", "--attention-dropout 0.1 ("]),
    ],
)  # fmt: skip
def test_fsdp_backend_refuses_megatron_only_flags_at_parse_time(flags, named, capsys):
    err = parse_error(with_flags("--train-backend", "fsdp", *flags), capsys)
    assert "--train-backend fsdp does not implement" in err and "--train-backend megatron" in err
    for fragment in named:
        assert fragment in err


def test_megatron_only_flags_are_accepted_by_megatron_and_off_values_by_fsdp():
    cfg = parse_args(with_flags("--megatron-to-hf-mode", "raw", "--recompute-granularity", "selective"))
    assert cfg.megatron.recompute_granularity == "selective" and cfg.train.train_backend == "megatron"
    off = ["--tensor-model-parallel-size", "1", "--expert-tensor-parallel-size", "1", "--megatron-to-hf-mode", "raw"]
    cfg = parse_args(with_flags("--train-backend", "fsdp", *off, "--gradient-checkpointing"))
    assert cfg.train.train_backend == "fsdp" and cfg.megatron.megatron_to_hf_mode == "raw"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--gradient-checkpointing"], ["--gradient-checkpointing (use --recompute-granularity full"]),
        (["--attn-implementation", "eager"], ["--attn-implementation eager (use --attention-backend)"]),
    ],
)
def test_megatron_backend_refuses_fsdp_only_flags(flags, named, capsys):
    err = parse_error(with_flags(*flags), capsys)  # the default --train-backend megatron
    assert "--train-backend megatron does not implement" in err and "--train-backend fsdp" in err
    for fragment in named:
        assert fragment in err


def test_fsdp_data_parallel_size_is_every_trainer_gpu(capsys):
    # 4 FSDP ranks, 2 samples each per micro-batch: optimizer steps of 8, 16, ... samples
    flags = ["--train-backend", "fsdp", "--actor-num-gpus-per-node", "4", "--micro-batch-size", "2",
             "--rollout-batch-size", "8"]  # fmt: skip
    err = parse_error(with_flags(*flags, "--global-batch-size", "4"), capsys)
    assert "data-parallel size 4 (= the 4 trainer GPUs) * --micro-batch-size 2 = 8" in err
    assert parse_args(with_flags(*flags, "--global-batch-size", "8")).train.global_batch_size == 8


@pytest.mark.parametrize("flag", ["--rollout-temperature", "--eval-temperature", "--eps-clip", "--eps-clip-high",
                                  "--lr", "--rm-tolerance", "--clip-grad", "--norm-epsilon", "--kl-coef"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_floats_are_refused_for_every_float_flag(flag, value, capsys):
    """float() accepts these spellings, and every range check (x > 0, 0 <= x < 1) lets NaN through."""
    err = parse_error(with_flags(f"{flag}={value}"), capsys)  # --x=-inf: argparse reads a bare -inf as a flag
    assert f"{flag} must be a finite number, got {float(value)}" in err


def test_non_finite_floats_inside_lists_are_refused():
    from slime.utils.config import check_finite

    check_finite("--x", [0.5, 1e300, 7])  # large but finite, and ints, pass
    with pytest.raises(ConfigError, match="--x must be a finite number, got inf"):
        check_finite("--x", [0.5, float("inf")])


def test_weight_sync_bucket_size_is_a_byte_count(capsys):
    from slime.weight_sync.config import DEFAULT_BUCKET_BYTES

    assert parse_args(BASE).weight_sync.update_weight_buffer_size is None  # the transport's default, below
    assert DEFAULT_BUCKET_BYTES == 512 * 1024**2  # upstream's default
    cfg = parse_args(with_flags("--update-weight-buffer-size", "1048576"))
    assert cfg.weight_sync.update_weight_buffer_size == 1 << 20
    err = parse_error(with_flags("--update-weight-buffer-size", "0"), capsys)
    assert "--update-weight-buffer-size must be >= 1, got 0" in err


def test_megatron_to_hf_mode_defaults_to_raw_and_takes_two_values(capsys):
    assert parse_args(BASE).megatron.megatron_to_hf_mode == "raw"
    err = parse_error(with_flags("--megatron-to-hf-mode", "hf"), capsys)
    assert "--megatron-to-hf-mode" in err and "'raw', 'bridge'" in err


# ---------------------------------------------------------------------------------------------
# Defaults in --help


def help_entries(text: str) -> dict[str, str]:
    """{flag: its help text} of a ``--help`` output printed with a wide COLUMNS (no wrapping)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  --"):
            current = re.match(r"\s+(--[\w-]+)", line)[1]  # "--on, --no-on" -> "--on"
            invocation = re.match(r"\s+--\S+(?: [^ ]+)*?(?:\s{2,}|$)", line)[0]
            entries[current] = line[len(invocation) :].strip()
        elif current and line.startswith("    "):  # argparse moves the help of a long invocation to the next line
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


def test_help_appends_each_default_once(monkeypatch):
    from slime.utils.config import flag

    @dataclasses.dataclass(kw_only=True)
    class Demo:
        """Demo."""

        count: int = flag(3, help="Count.")
        rate: float = flag(1e-6, help="Rate.")
        zero: float = flag(0.0, help="Zero is shown.")
        name: str = flag("a b", help="Name.")
        percent: str = flag("50%", help="Percent.")
        ids: list[int] = flag(default_factory=lambda: [1, 2], help="Ids.")
        keys: dict = flag(default_factory=lambda: {"image": "images"}, type=json.loads, help="Keys.")
        on: bool = flag(True, help="On.")
        off: bool = flag(False, help="Off.")
        unset: int | None = flag(None, help="Unset.")
        empty: list[str] = flag(default_factory=list, help="Empty.")
        said: str = flag("x", help="Said (default: x, the usual).")
        needed: int = flag(help="Required.")

    import argparse

    from slime.utils.config import add_group

    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    parser = argparse.ArgumentParser(prog="p")
    add_group(parser, Demo, "GROUP")
    entries = help_entries(parser.format_help())
    assert entries["--count"] == "Count. (default: 3)"
    assert entries["--rate"] == "Rate. (default: 1e-06)"
    assert entries["--zero"] == "Zero is shown. (default: 0.0)"
    assert entries["--name"] == "Name. (default: 'a b')"
    assert entries["--percent"] == "Percent. (default: 50%)"
    assert entries["--ids"] == "Ids. (default: 1 2)"
    assert entries["--keys"] == 'Keys. (default: {"image":"images"})'
    assert entries["--on"] == "On. (default: on)"
    assert entries["--off"] == "Off."
    assert entries["--unset"] == "Unset."
    assert entries["--empty"] == "Empty."
    assert entries["--said"] == "Said (default: x, the usual)."
    assert entries["--needed"] == "Required."


def test_real_help_shows_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    text = build_parser().format_help()
    lines = help_entries(text)
    assert lines["--lr"] == "Peak learning rate. (default: 1e-06)" and "  --lr FLOAT " in text
    assert lines["--rollout-temperature"].endswith("(default: 1.0)")
    assert lines["--train-backend"].endswith("(default: megatron)")
    assert lines["--megatron-to-hf-mode"].endswith("(default: raw)")
    assert lines["--apply-chat-template-kwargs"].endswith("(default: {})")
    assert "math (default)" in lines["--rm-type"] and "(default: math)" not in lines["--rm-type"]
    assert "(default" not in lines["--num-layers"]  # None: taken from the checkpoint
    estimators = lines["--advantage-estimator"]  # once "(registered name)", naming none of them
    assert all(f"{name} (" in estimators for name in ADVANTAGE_ESTIMATORS.names()) and "(default: grpo)" in estimators
    assert f"Default: 512 MiB ({512 * 2**20} bytes" in lines["--update-weight-buffer-size"]


# ---------------------------------------------------------------------------------------------
# Stop token ids


def test_negative_stop_token_ids_are_refused(capsys):
    err = parse_error(with_flags("--rollout-stop-token-ids", "2", "-5"), capsys)
    assert "--rollout-stop-token-ids must be token ids >= 0, got -5" in err
    assert parse_args(with_flags("--rollout-stop-token-ids", "0", "7")).rollout.rollout_stop_token_ids == [0, 7]


@pytest.mark.parametrize("flags, message", [
    (["--save", ""], "--save must be a folder, got an empty string"),
    (["--save", " ", "--save-interval", "3"], "--save must be a folder"),  # '' passed --save-interval's check
    (["--load", ""], "--load must be a folder"),
    (["--ref-load", ""], "--ref-load must be a folder"),
    (["--output-dir", ""], "--output-dir must be a folder"),
    (["--save", "ckpts", "--save-hf", "", "--train-backend", "megatron"], "--save-hf must be a folder"),
])  # fmt: skip
def test_an_empty_path_is_refused_not_read_as_not_given(flags, message, capsys):
    """``--save ''`` used to read as "no --save" downstream: nothing saved, --save-hf silently dropped, and the
    launcher pointing its resume line at checkpoints that were never written."""
    assert message in parse_error(with_flags("--rollout-backend", "transformers", *flags), capsys)


def test_use_tis_with_use_rollout_logprobs_is_refused(capsys):
    err = parse_error(with_flags("--use-tis", "--use-rollout-logprobs"), capsys)
    assert "--use-tis with --use-rollout-logprobs" in err
    cfg = parse_args(with_flags("--use-tis", "--tis-mode", "icepop", "--tis-clip-low", "0.5", "--use-opsm"))
    assert (cfg.grpo.use_tis, cfg.grpo.tis_mode, cfg.grpo.tis_clip_low, cfg.grpo.use_opsm) == (True, "icepop", 0.5, True)
    assert "--tis-clip-low 3.0 must be below --tis-clip 2.0" in parse_error(with_flags("--tis-clip-low", "3"), capsys)


@pytest.mark.parametrize("flags, message", [
    (["--use-rollout-logprobs"], "--use-rollout-logprobs from the rollout: drop one"),
    (["--use-routing-replay"], "whose routes --use-routing-replay records for the training forward"),
    (["--global-batch-size", "4"], "--global-batch-size 4 makes 2 of the 8 samples"),
    (["--kl-coef", "0.01", "--normalize-advantages"], "with --kl-coef 0.01 and --normalize-advantages"),
    (["--debug-rollout-only"], "--debug-rollout-only runs no training step, so --skip-actor-forward-only"),
])  # fmt: skip
def test_skip_actor_forward_only_is_refused_where_the_pass_is_needed(flags, message, capsys):
    cfg = parse_args(with_flags("--skip-actor-forward-only"))
    assert cfg.train.skip_actor_forward_only and cfg.steps_per_rollout == 1
    assert message in parse_error(with_flags("--skip-actor-forward-only", *flags), capsys)

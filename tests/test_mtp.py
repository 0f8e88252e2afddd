"""Qwen3.5's MTP layer (:mod:`slime.checkpoints.mtp`): the tensors SGLang's draft model loads, a random layer added to
a checkpoint, every loader and the weight sync leaving it alone, and the parse-time check of speculative decoding.

SGLang is not installed on the CPU machine, so what SGLang 0.5.17 loads is written out here from its source
(``sglang/srt/models/qwen3_5_mtp.py`` ``Qwen3_5ForCausalLMMTP.__init__`` and ``load_weights``,
``sglang/srt/models/qwen3_5.py`` ``Qwen3_5ForCausalLM`` / ``Qwen3_5AttentionDecoderLayer``,
``sglang/srt/models/qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock`` / ``Qwen2MoeMLP`` and
``sglang/srt/layers/moe/fused_moe_triton/layer.py`` ``FusedMoE.make_expert_params_mapping``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slime.checkpoints.mtp import (
    MTP_CONFIG_FIELDS,
    MTP_FILE,
    MTP_PREFIX,
    mtp_problem,
    mtp_tensor_shapes,
    weight_map,
    write_mtp_layer,
)
from slime.utils.config import ConfigError


def sglang_mtp_param(name: str) -> tuple[str, object] | None:
    """``(parameter of Qwen3_5ForCausalLMMTP, shard)`` that SGLang 0.5.17's ``load_weights`` loads checkpoint tensor
    ``name`` into (None: skipped), following qwen3_5_mtp.py's ``load_weights`` step by step (TP 1, unfused experts)."""
    if "rotary_emb.inv_freq" in name or "mtp" not in name:
        return None
    if name.startswith("mtp."):
        name = name.replace("mtp.", "model.").replace("model.fc", "fc").replace("model.pre_fc", "pre_fc")
    if ".self_attn." in name:
        name = name.replace(".self_attn", "")
    for param, shard_name, shard in (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                                     ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                                     ("gate_up_proj", "up_proj", 1)):
        if shard_name in name and "mlp.experts" not in name:
            return name.replace(shard_name, param), shard
    if "mlp.experts." in name:  # make_expert_params_mapping: experts.<e>.<proj>. -> experts.w13_ / experts.w2_
        prefix, rest = name.split("mlp.experts.", 1)
        expert, proj, _ = rest.split(".", 2)
        param = "experts.w13_weight" if proj in ("gate_proj", "up_proj") else "experts.w2_weight"
        return f"{prefix}mlp.{param}", (int(expert), {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj])
    return name, None


SGLANG_MTP_PARAMS = {
    # Qwen3_5ForCausalLMMTP.__init__: fc, the two pre-fc norms; its model (a one-layer Qwen3_5ForCausalLM built with
    # full_attention_interval 1, so the layer is Qwen3_5AttentionDecoderLayer) and the final norm.  embed_tokens and
    # lm_head exist too but are the target's (set_embed_and_head), never loaded from mtp.* names.
    "fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "model.norm.weight",
    "model.layers.0.qkv_proj.weight", "model.layers.0.o_proj.weight", "model.layers.0.q_norm.weight",
    "model.layers.0.k_norm.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    # Qwen2MoeSparseMoeBlock: gate (router), experts (FusedMoE), shared_expert (Qwen2MoeMLP), shared_expert_gate
    "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight",
    "model.layers.0.mlp.shared_expert.gate_up_proj.weight", "model.layers.0.mlp.shared_expert.down_proj.weight",
    "model.layers.0.mlp.shared_expert_gate.weight",
}

RELEASED_35B_A3B = {
    # Qwen/Qwen3.5-35B-A3B's MTP tensors (hidden 2048, 16 query heads of 256 with their output gate, 2 KV heads,
    # 256 experts of 512, a shared expert of 512): 785 of them, 768 of which are the experts'.
    "mtp.fc.weight": (2048, 4096), "mtp.norm.weight": (2048,), "mtp.pre_fc_norm_embedding.weight": (2048,),
    "mtp.pre_fc_norm_hidden.weight": (2048,), "mtp.layers.0.input_layernorm.weight": (2048,),
    "mtp.layers.0.post_attention_layernorm.weight": (2048,), "mtp.layers.0.self_attn.q_proj.weight": (8192, 2048),
    "mtp.layers.0.self_attn.k_proj.weight": (512, 2048), "mtp.layers.0.self_attn.v_proj.weight": (512, 2048),
    "mtp.layers.0.self_attn.o_proj.weight": (2048, 4096), "mtp.layers.0.self_attn.q_norm.weight": (256,),
    "mtp.layers.0.self_attn.k_norm.weight": (256,), "mtp.layers.0.mlp.gate.weight": (256, 2048),
    "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (512, 2048),
    "mtp.layers.0.mlp.shared_expert.up_proj.weight": (512, 2048),
    "mtp.layers.0.mlp.shared_expert.down_proj.weight": (2048, 512),
    "mtp.layers.0.mlp.shared_expert_gate.weight": (1, 2048),
    "mtp.layers.0.mlp.experts.0.gate_proj.weight": (512, 2048), "mtp.layers.0.mlp.experts.255.up_proj.weight": (512, 2048),
    "mtp.layers.0.mlp.experts.17.down_proj.weight": (2048, 512),
}


def test_the_released_35b_a3b_mtp_layer_has_785_tensors_of_these_shapes():
    from transformers import Qwen3_5MoeConfig  # its defaults are the released 35B-A3B

    shapes = mtp_tensor_shapes(Qwen3_5MoeConfig().text_config.to_dict())
    assert len(shapes) == 785
    assert all(name.startswith(MTP_PREFIX) for name in shapes)
    assert {n: shapes[n] for n in RELEASED_35B_A3B} == RELEASED_35B_A3B
    with pytest.raises(ValueError, match="num_experts"):
        mtp_tensor_shapes({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1})


def test_sglangs_mtp_loader_fills_every_draft_parameter_from_the_written_layer(tiny_ckpt):
    """Every tensor maps to a parameter of SGLang's draft model, every parameter gets its tensors, each shard once,
    and the shapes add up to SGLang's fused parameters (qkv_proj rows: [q; gate] per head, then k, then v)."""
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    shapes = mtp_tensor_shapes(text)
    loads: dict[str, list] = {}
    for name, shape in shapes.items():
        mapped = sglang_mtp_param(name)
        assert mapped is not None, name
        loads.setdefault(mapped[0], []).append((mapped[1], shape))
    assert set(loads) == SGLANG_MTP_PARAMS
    h, heads, kv, d = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    experts, inter = text["num_experts"], text["moe_intermediate_size"]
    qkv = dict(loads["model.layers.0.qkv_proj.weight"])
    assert sorted(qkv) == ["k", "q", "v"]
    assert sum(s[0] for s in qkv.values()) == (2 * heads + 2 * kv) * d and {s[1] for s in qkv.values()} == {h}
    w13 = loads["model.layers.0.mlp.experts.w13_weight"]
    assert sorted(shard for shard, _ in w13) == sorted((e, w) for e in range(experts) for w in ("w1", "w3"))
    assert {shape for _, shape in w13} == {(inter, h)}
    w2 = loads["model.layers.0.mlp.experts.w2_weight"]
    assert sorted(shard for shard, _ in w2) == [(e, "w2") for e in range(experts)] and {s for _, s in w2} == {(h, inter)}
    assert loads["fc.weight"] == [(None, (h, 2 * h))]
    # the main model's loader (qwen3_5.py Qwen3_5ForCausalLM.load_weights) skips every name holding "mtp"
    assert sglang_mtp_param("model.language_model.layers.0.mlp.gate.weight") is None


@pytest.fixture
def mtp_ckpt(tiny_ckpt, tmp_path) -> Path:
    """A copy of the tiny checkpoint with a random MTP layer."""
    folder = tmp_path / "tiny-mtp"
    shutil.copytree(tiny_ckpt, folder)
    write_mtp_layer(folder, seed=3, dtype=torch.float32)
    return folder


def test_write_mtp_layer_adds_a_seeded_layer_the_index_and_the_config_fields(tiny_ckpt, mtp_ckpt, tmp_path):
    text = json.loads((mtp_ckpt / "config.json").read_text())["text_config"]
    assert {k: text[k] for k in MTP_CONFIG_FIELDS} == {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    model = load_file(tiny_ckpt / "model.safetensors")
    mtp = load_file(mtp_ckpt / MTP_FILE)
    assert {n: tuple(t.shape) for n, t in mtp.items()} == mtp_tensor_shapes(text)
    assert len(mtp) == 17 + 3 * text["num_experts"]
    index = json.loads((mtp_ckpt / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {**dict.fromkeys(model, "model.safetensors"), **dict.fromkeys(mtp, MTP_FILE)}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in (*model.values(), *mtp.values()))
    assert weight_map(mtp_ckpt) == index["weight_map"]
    assert load_file(mtp_ckpt / "model.safetensors").keys() == model.keys()  # the model's file is untouched
    # norms 0 (scale 1 in Qwen3.5's 1 + w norms), matrices ~ N(0, initializer_range)
    assert all(not t.any() for t in mtp.values() if t.dim() == 1)
    matrices = torch.cat([t.flatten() for t in mtp.values() if t.dim() == 2]).double()
    assert abs(matrices.std().item() - text["initializer_range"]) < 0.05 * text["initializer_range"]
    assert abs(matrices.mean().item()) < 1e-3
    again = tmp_path / "again"
    shutil.copytree(tiny_ckpt, again)
    write_mtp_layer(again, seed=3, dtype=torch.float32)
    assert all(torch.equal(t, load_file(again / MTP_FILE)[n]) for n, t in mtp.items())  # same seed, same weights
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    write_mtp_layer(other, seed=4)
    assert load_file(other / MTP_FILE)["mtp.fc.weight"].dtype == torch.bfloat16  # the released dtype by default
    assert not torch.equal(load_file(other / MTP_FILE)["mtp.fc.weight"].float(), mtp["mtp.fc.weight"].bfloat16().float())
    with pytest.raises(FileExistsError, match="already has mtp"):
        write_mtp_layer(mtp_ckpt)


def test_mtp_problem_names_what_the_checkpoint_lacks(tiny_ckpt, mtp_ckpt, tmp_path):
    problem = mtp_problem(tiny_ckpt)
    assert "mtp_num_hidden_layers" in problem and "no mtp.* tensor" in problem
    assert mtp_problem(mtp_ckpt) is None
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_ckpt, config_only)
    config = json.loads((config_only / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (config_only / "config.json").write_text(json.dumps(config))
    assert mtp_problem(config_only) == "its safetensors weights hold no mtp.* tensor (the MTP layer)"
    assert mtp_problem("Qwen/Qwen3.5-35B-A3B") is None  # a hub name: nothing to tell here


def test_the_megatron_loader_skips_the_mtp_layer_and_reports_it(tiny_ckpt, mtp_ckpt):
    pytest.importorskip("megatron.core")
    from qwen35_helpers import megatron_on_cpu

    from slime.models.qwen3_5.config import qwen35_config_from_hf
    from slime.models.qwen3_5.model import Qwen35Model
    from slime.models.qwen3_5.weights import export_hf_weights, load_hf_checkpoint

    tensors = load_file(tiny_ckpt / "model.safetensors")
    num_experts = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]["num_experts"]
    with megatron_on_cpu():
        config = qwen35_config_from_hf(mtp_ckpt, params_dtype=torch.float32, moe_token_dispatcher_type="allgather",
                                       use_cpu_initialization=True, perform_initialization=False)
        with torch.device("meta"):
            model = Qwen35Model(config)
        report = load_hf_checkpoint(model, mtp_ckpt)
        out = dict(export_hf_weights(model))
    assert report.skipped == {MTP_PREFIX: 17 + 3 * num_experts}  # skipped by name, none missing or "other"
    assert out.keys() == tensors.keys()  # the export (what the weight sync sends) has no mtp.* name
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_transformers_loads_the_checkpoint_and_ignores_the_mtp_layer(tiny_ckpt, mtp_ckpt):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(mtp_ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    reference = AutoModelForImageTextToText.from_pretrained(tiny_ckpt)
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys() and not any("mtp" in n for n in ours)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def _fsdp_rank(rank: int, mtp_ckpt: str, tiny_ckpt: str) -> None:
    """One FSDP rank: load the checkpoint with its MTP layer as the FSDP backend does, and check what the weight sync
    would send (:func:`slime.backends.fsdp.hf_io.iter_hf_weight_buckets`): the model's tensors, bit for bit, no mtp.*."""
    from torch.distributed.device_mesh import init_device_mesh

    from slime.backends.fsdp.hf_io import iter_hf_weight_buckets, load_sharded_model

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = load_sharded_model(mtp_ckpt, mesh=mesh, device=torch.device("cpu"), dtype=torch.float32,
                               attn_implementation="sdpa")
    sent = {name: t for bucket in iter_hf_weight_buckets(model, torch.float32, 1 << 20) for name, t in bucket}
    expected = load_file(Path(tiny_ckpt) / "model.safetensors")
    assert sent.keys() == expected.keys(), sorted(set(sent) ^ set(expected))[:5]
    assert all(torch.equal(sent[n], t) for n, t in expected.items())


def test_the_fsdp_loader_and_its_weight_sync_leave_the_mtp_layer_out(tiny_ckpt, mtp_ckpt):
    from scripts.harness.spawn_ranks import spawn_ranks

    spawn_ranks(_fsdp_rank, str(mtp_ckpt), str(tiny_ckpt), world_size=1)


SPECULATIVE = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2",
               "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3"]


def test_upstreams_four_flags_are_the_ones_slime_passes():
    from slime.rollout.engines.sglang.config import MTP_SPECULATIVE_FLAGS

    assert ["--sglang-" + f[2:] if f.startswith("--") else f for f in MTP_SPECULATIVE_FLAGS] == SPECULATIVE


def _argv(ckpt, engine: str, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(ckpt), "--prompt-data", "unused", "--num-rollout", "1", "--rollout-batch-size", "1",
            "--rollout-max-response-len", "8", "--train-backend", "fsdp", "--rollout-backend", engine,
            "--rollout-num-gpus", "1", *extra]


def test_speculative_decoding_on_a_checkpoint_without_its_mtp_layer_is_refused_naming_both(tiny_ckpt, capsys):
    from slime.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(_argv(tiny_ckpt, "sglang", *SPECULATIVE))
    err = capsys.readouterr().err
    assert "--sglang-speculative-algorithm EAGLE" in err and f"--hf-checkpoint {tiny_ckpt}" in err
    assert "mtp_num_hidden_layers" in err and "no mtp.* tensor" in err
    # with the transformers engine they are refused as every --sglang-* flag is
    with pytest.raises(SystemExit):
        parse_args(_argv(tiny_ckpt, "transformers", *SPECULATIVE))
    assert "does not run SGLang" in capsys.readouterr().err


def test_the_sglang_engine_takes_speculative_flags_with_the_mtp_layer(tiny_ckpt, mtp_ckpt):
    from slime.rollout.engines.sglang.flags import extract_sglang_args
    from slime.rollout.engines.sglang.config import SGLangEngineConfig

    sglang, _ = extract_sglang_args(SPECULATIVE)
    SGLangEngineConfig.check(None, sglang, str(mtp_ckpt))
    SGLangEngineConfig.check(None, sglang, "Qwen/Qwen3.5-35B-A3B")  # a hub name: SGLang itself will tell
    for given in (["--sglang-speculative-algorithm", "NEXTN"], ["--sglang-speculative-algorithm", "eagle"]):
        with pytest.raises(ConfigError, match="MTP layer"):
            SGLangEngineConfig.check(None, extract_sglang_args(given)[0], str(tiny_ckpt))
    own_draft, _ = extract_sglang_args([*SPECULATIVE, "--sglang-speculative-draft-model-path", "/draft"])
    SGLangEngineConfig.check(None, own_draft, str(tiny_ckpt))  # a draft model of its own needs no MTP layer
    ngram, _ = extract_sglang_args(["--sglang-speculative-algorithm", "NGRAM"])
    SGLangEngineConfig.check(None, ngram, str(tiny_ckpt))
    with pytest.raises(ConfigError, match="abbreviates --sglang-speculative-algorithm"):
        SGLangEngineConfig.check(None, extract_sglang_args(["--sglang-speculative-algo", "EAGLE"])[0], str(tiny_ckpt))


def test_a_colocated_server_with_speculative_decoding_backs_up_the_drafts_weights():
    """The memory saver discards released weights; the sync restores the model's but never sends the draft layer,
    so SGLang must keep a CPU copy of the draft's."""
    from slime.rollout.engines.sglang.launch import ServerSpec, server_command

    flags = tuple(f.replace("--sglang-", "--") for f in SPECULATIVE)
    spec = ServerSpec(model_path="/ckpt", tp_size=1, host="127.0.0.1", port=1, seed=0, colocated=True,
                      passthrough=flags)
    command = server_command(spec, python="/py")
    assert command.count("--enable-draft-weights-cpu-backup") == 1
    assert command[-len(flags):] == list(flags)
    for other in (dataclasses_replace(spec, colocated=False), dataclasses_replace(spec, passthrough=())):
        assert "--enable-draft-weights-cpu-backup" not in server_command(other, python="/py")
    for given in ("--enable-draft-weights-cpu-backup", "--enable-weights-cpu-backup"):
        mine = server_command(dataclasses_replace(spec, passthrough=(*flags, given)), python="/py")
        assert mine.count("--enable-draft-weights-cpu-backup") == (given == "--enable-draft-weights-cpu-backup")


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _mtp_sync(monkeypatch):
    """``scripts/bench/mtp_sync.py`` as a module (its ``sys.path`` additions undone after the test)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "mtp_sync.py"
    spec = importlib.util.spec_from_file_location("mtp_sync_under_test", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_bench_moves_every_parameter_by_its_seeded_relative_noise(monkeypatch):
    import types

    module = _mtp_sync(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = [p.detach().double().clone() for p in model.parameters()]
    actor = types.SimpleNamespace(backend=types.SimpleNamespace(model=model))
    assert module.perturb_parameters(actor, 0.01, 7) == 4
    for i, (param, old) in enumerate(zip(model.parameters(), before)):
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(7 + i)).double()
        torch.testing.assert_close(param.detach().double(), old * (1 + 0.01 * noise), rtol=1e-6, atol=1e-7)


def test_the_bench_reports_every_gap_and_the_gates_own_verdict(monkeypatch):
    """The check runs with bounds that never refuse; the verdict at the default bounds is reported beside the gaps."""
    import types

    from slime.rollout.config import ParityConfig

    module = _mtp_sync(monkeypatch)

    def run_with(text_gap):
        metrics = {"parity/logprob_gap_image": 0.05, "parity/logprob_gap_text": text_gap,
                   "parity/logprob_gap_image_max": 0.4, "parity/logprob_gap_text_max": 0.5, "parity/tokens_image": 64.0,
                   "parity/tokens_text": 64.0, "parity/trainer_floor_image": 0.03, "parity/trainer_floor_text": 0.03,
                   "parity/skipped_vision_token_responses": 0.0}
        parity = types.SimpleNamespace(compare=lambda trainers, samples, rollout_id: metrics)
        return types.SimpleNamespace(parity=parity, trainers=None)

    # floors of 0.03 nats (a real-width bf16 trainer's): 0.04 <= 3 x 0.03 passes, 0.5 > 0.09 is refused
    ok = module.compare(run_with(0.04), [], 0, ParityConfig())
    assert ok["verdict"] == "pass" and ok["parity/logprob_gap_text"] == 0.04
    refused = module.compare(run_with(0.5), [], 1, ParityConfig())
    assert refused["verdict"].startswith("text-prompt gap 0.5 nats > 3 x the trainer's own floor 0.03")


def test_the_bench_sync_runs_parse_with_and_without_mtp(tiny_ckpt, mtp_ckpt, monkeypatch, tmp_path):
    """``scripts/bench/mtp_sync.py``'s runs are valid slime commands (the engine's package check aside: no SGLang
    here), colocated, with the speculative flags only on the ``mtp`` server."""
    import slime.arguments

    module = _mtp_sync(monkeypatch)
    monkeypatch.setattr(slime.arguments, "_check_runs_here", lambda cfg: None)
    none = slime.arguments.parse_args(module.run_argv(str(mtp_ckpt), "none", 8, 128, tmp_path))
    mtp = slime.arguments.parse_args(module.run_argv(str(mtp_ckpt), "mtp", 8, 128, tmp_path))
    assert none.cluster.colocate and mtp.cluster.colocate
    assert "speculative_algorithm" not in none.sglang.server_args
    assert mtp.sglang.to_argv()[-len(SPECULATIVE):] == SPECULATIVE
    assert (mtp.parity.engine_parity_prompts, mtp.parity.engine_parity_response_len) == (8, 128)
    assert none.sglang.server_args["mem_fraction_static"] == "0.7"  # the launcher's, unless asked otherwise
    smaller = slime.arguments.parse_args(module.run_argv(str(mtp_ckpt), "mtp", 8, 128, tmp_path, mem_fraction=0.6))
    assert smaller.sglang.server_args["mem_fraction_static"] == "0.6"
    with pytest.raises(SystemExit):
        slime.arguments.parse_args(module.run_argv(str(tiny_ckpt), "mtp", 8, 128, tmp_path))


@pytest.mark.slow
def test_the_sync_bench_runs_through_slimes_driver_on_cpu(tiny_ckpt, monkeypatch, tmp_path):
    """``mtp_sync.measure_server`` end to end on the CPU: the transformers engine in place of SGLang (its parity probe
    switched on here), the FSDP trainer, Ray.  The engine computes the trainer's model exactly, so both gaps are 0:
    after the 1 % move, only because the sync carried it (the trainer's log-probs move with it)."""
    import sys
    import types

    from slime.rollout.engines.hf_engine import TransformersEngine

    import importlib

    module = _mtp_sync(monkeypatch)
    monkeypatch.setitem(sys.modules, "sglang_rollout_bench", None)  # undone at teardown: the import below goes
    del sys.modules["sglang_rollout_bench"]
    bench = importlib.import_module("sglang_rollout_bench")  # the one mtp_sync imports (scripts/bench on its path)
    monkeypatch.setattr(TransformersEngine, "parity_check", True)
    monkeypatch.setattr(bench, "record_spec_meta", lambda actor: None)  # no SGLang client, no spec_* figures
    monkeypatch.setattr(bench, "engine_acceptance", lambda engines: None)
    sglang_run_argv = module.run_argv

    def cpu_argv(model, server, prompts, response_len, out, mem_fraction):
        argv, keep = sglang_run_argv(model, server, prompts, response_len, out, mem_fraction), []
        for token in argv:
            if token.startswith("--sglang-") or token in ("--colocate", "--bf16", "--gradient-checkpointing"):
                keep.append(None)  # this flag and its values are dropped
            elif token.startswith("--") or keep[-1:] != [None]:
                keep.append(token)
        argv = [t for t in keep if t is not None]
        argv[argv.index("--rollout-backend") + 1] = "transformers"
        return [*argv, "--rollout-num-gpus", "1"]

    monkeypatch.setattr(module, "run_argv", cpu_argv)
    args = types.SimpleNamespace(model=str(tiny_ckpt), prompts=2, response_len=8, perturb=0.01, seed=0,
                                 mem_fraction_static=0.7,
                                 json=str(tmp_path / "figures.jsonl"), out=str(tmp_path / "runs"))
    module.measure_server("none", args)
    rows = [json.loads(line) for line in (tmp_path / "figures.jsonl").read_text().splitlines()]
    assert [(r["server"], r["phase"]) for r in rows] == [("none", "before_sync"), ("none", "after_sync")]
    assert rows[0]["parameters_moved"] > 0 and rows[1]["sync_s"] is not None
    for row in rows:
        assert row["verdict"] == "pass" and row["parity/tokens_image"] == row["parity/tokens_text"] == 16
        assert row["parity/logprob_gap_image"] == row["parity/logprob_gap_text"] == 0.0


def test_fused_experts_of_an_mtp_layer_do_not_decide_the_models_expert_layout():
    """Some checkpoints store the MTP layer's experts fused while the model's are per expert: the loader must read the
    model's per-expert tensors then."""
    from slime.models.qwen3_5.hf_mapping import checkpoint_has_fused_experts
    from slime.models.qwen3_5.weights import StateDictReader

    per_expert = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight"
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    mtp_fused = "mtp.layers.0.mlp.experts.gate_up_proj"
    assert not checkpoint_has_fused_experts(StateDictReader({per_expert: torch.zeros(1), mtp_fused: torch.zeros(1)}))
    assert checkpoint_has_fused_experts(StateDictReader({fused: torch.zeros(1), mtp_fused: torch.zeros(1)}))

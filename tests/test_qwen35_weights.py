"""HF checkpoint -> per-rank native shards -> HF round trip: bit-exact on the tiny checkpoint for several
TP / EP / ETP / PP layouts, names and shapes on the 35B-A3B config built on the meta device.

The group gathers of the exporter are simulated: every rank's shards are read with its own rules and
handed to the rule's ``export`` in group-rank order, as ``export_hf_weights`` does after its all-gather.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime.models.qwen3_5.config import arch_from_hf_config
from slime.models.qwen3_5.hf_mapping import VISUAL, ModelLayout, Ranks, WeightMappingError, param_rules
from slime.models.qwen3_5.weights import StateDictReader, read_rank_state


def _vision_names(tensors: dict) -> list[tuple[str, tuple[int, ...]]]:
    return [(n[len(VISUAL):], tuple(t.shape)) for n, t in tensors.items() if n.startswith(VISUAL)]


def export_all(reader, arch, vision_names, *, tp=1, ep=1, etp=1, pp=1, fused=False) -> dict[str, torch.Tensor]:
    """Every rank's shards (read through its rules), gathered per group and exported, merged over stages / EP."""
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        layout = ModelLayout.for_stage(arch, pp_rank, pp)
        for ep_rank in range(ep):
            states = {}
            for tp_rank in range(tp):
                for etp_rank in range(etp):
                    rules = param_rules(arch, layout, Ranks(tp_rank, tp, ep_rank, ep, etp_rank, etp),
                                        fused_experts=fused, vision_names=vision_names)
                    states[tp_rank, etp_rank] = rules, read_rank_state(reader, rules)
            for name, rule in states[0, 0][0].items():
                if rule.group == "tp":
                    shards = [states[t, 0][1][name] for t in range(tp)]
                elif rule.group == "etp":
                    shards = [states[0, e][1][name] for e in range(etp)]
                else:
                    shards = [states[0, 0][1][name]]
                for hf_name, tensor in rule.export(shards).items():
                    if hf_name in out and not tensor.is_meta:  # dense tensors come again from every EP rank
                        assert torch.equal(out[hf_name], tensor), hf_name
                    out[hf_name] = tensor
    return out


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    tensors = load_file(tiny_ckpt / "model.safetensors")
    arch = arch_from_hf_config(json.loads((tiny_ckpt / "config.json").read_text()))
    return tensors, arch


@pytest.mark.parametrize(
    "tp, ep, etp, pp",
    [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 1), (1, 8, 1, 2), (2, 4, 2, 4)],
)
def test_tiny_round_trip_is_bit_exact(tiny, tp, ep, etp, pp):
    tensors, arch = tiny
    out = export_all(StateDictReader(tensors), arch, _vision_names(tensors), tp=tp, ep=ep, etp=etp, pp=pp)
    assert out.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def test_fused_in_memory_experts_load_and_export_per_expert(tiny, tiny_ckpt):
    """transformers keeps experts fused in memory; reading those gives the same shards as the per-expert files."""
    from transformers import AutoModelForImageTextToText

    tensors, arch = tiny
    memory = {n: p.detach() for n, p in AutoModelForImageTextToText.from_pretrained(tiny_ckpt).named_parameters()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in memory
    out = export_all(StateDictReader(memory), arch, _vision_names(tensors), tp=2, ep=2, fused=True)
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_local_layouts_by_hand(tiny):
    """Spot checks of the layouts against slices written out by hand (TP 2, rank 1; EP 2, rank 1)."""
    tensors, arch = tiny
    layout = ModelLayout(layers=((0, 0), (1, 3)), pre_process=False, post_process=False, vision=False)
    state = read_rank_state(StateDictReader(tensors), param_rules(arch, layout, Ranks(1, 2, 1, 2, 0, 1)))
    L = "model.language_model.layers."
    # Attention (layer 3): rank 1 has query heads 2, 3 and KV head 1; q_proj rows are [q_h; gate_h] per head.
    q_proj = tensors[f"{L}3.self_attn.q_proj.weight"].view(4, 2, 32, 64)
    want = torch.cat([q_proj[2:, 0].reshape(64, 64), q_proj[2:, 1].reshape(64, 64),
                      tensors[f"{L}3.self_attn.k_proj.weight"][32:], tensors[f"{L}3.self_attn.v_proj.weight"][32:]])
    assert torch.equal(state["decoder.layers.1.self_attention.linear_qkv.weight"], want)
    # GDN (layer 0): key head 1 (16 rows of q, of k), value heads 2, 3 (32 rows of v, z; 2 of b, a).
    qkv = tensors[f"{L}0.linear_attn.in_proj_qkv.weight"]
    want = torch.cat([qkv[16:32], qkv[48:64], qkv[96:128], tensors[f"{L}0.linear_attn.in_proj_z.weight"][32:],
                      tensors[f"{L}0.linear_attn.in_proj_b.weight"][2:], tensors[f"{L}0.linear_attn.in_proj_a.weight"][2:]])
    assert torch.equal(state["decoder.layers.0.self_attention.in_proj.weight"], want)
    assert torch.equal(state["decoder.layers.0.self_attention.out_proj.weight"],
                       tensors[f"{L}0.linear_attn.out_proj.weight"][:, 32:])
    # Experts: EP rank 1 of 2 holds experts 4..7; weight1 rows [gate; up].
    e5 = torch.cat([tensors[f"{L}0.mlp.experts.5.gate_proj.weight"], tensors[f"{L}0.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(state["decoder.layers.0.mlp.experts.weight1"][1], e5)
    assert torch.equal(state["decoder.layers.0.mlp.shared_experts.gate_weight"],
                       tensors[f"{L}0.mlp.shared_expert_gate.weight"])


def test_vocab_padding_rows_are_zero_and_dropped_on_export(tiny):
    tensors, arch = tiny
    layout = ModelLayout(layers=(), pre_process=True, post_process=True, vision=False)
    shards = [read_rank_state(StateDictReader(tensors), param_rules(arch, layout, Ranks(r, 3))) for r in range(3)]
    per = -(-arch.vocab_size // 3)
    assert shards[2]["embedding.weight"].shape == (per, arch.hidden_size)
    pad = 3 * per - arch.vocab_size
    assert pad > 0 and torch.equal(shards[2]["output_layer.weight"][-pad:], torch.zeros(pad, arch.hidden_size))
    rule = param_rules(arch, layout, Ranks(0, 3))["output_layer.weight"]
    assert torch.equal(rule.export([s["output_layer.weight"] for s in shards])["lm_head.weight"], tensors["lm_head.weight"])


def test_missing_and_misshapen_tensors_are_named(tiny):
    tensors, arch = tiny
    rules = param_rules(arch, ModelLayout.for_stage(arch), vision_names=_vision_names(tensors))
    broken = dict(tensors)
    del broken["model.language_model.layers.2.linear_attn.A_log"]
    with pytest.raises(WeightMappingError, match=r"decoder\.layers\.2\.self_attention\.A_log: checkpoint has no "
                                                 r"model\.language_model\.layers\.2\.linear_attn\.A_log"):
        read_rank_state(StateDictReader(broken), rules)
    broken = dict(tensors)
    broken["model.language_model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightMappingError, match=r"decoder\.final_layernorm\.weight: read \(3,\)"):
        read_rank_state(StateDictReader(broken), rules)


def _on_disk_names_and_shapes(memory: dict) -> dict[str, tuple[int, ...]]:
    """transformers' in-memory names -> its on-disk (save_pretrained) names: experts split per expert."""
    out = {}
    for name, t in memory.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, (E, two_i, h) = name[: -len("gate_up_proj")], t.shape
            for e in range(E):
                out[f"{prefix}{e}.gate_proj.weight"] = out[f"{prefix}{e}.up_proj.weight"] = (two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):
            prefix, (E, h, i) = name[: -len("down_proj")], t.shape
            for e in range(E):
                out[f"{prefix}{e}.down_proj.weight"] = (h, i)
        else:
            out[name] = tuple(t.shape)
    return out


def test_35b_a3b_names_and_shapes_on_meta():
    """Qwen3.5-35B-A3B (transformers' default config, 40 layers, 256 experts) on the meta device:
    TP 2 x EP 8 x PP 4 shards export back to exactly the checkpoint's names and shapes."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig()
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(config)
    memory = dict(model.state_dict())
    arch = arch_from_hf_config(config.to_dict())
    vision = [(n[len(VISUAL):], tuple(t.shape)) for n, t in memory.items() if n.startswith(VISUAL)]
    out = export_all(StateDictReader(memory), arch, vision, tp=2, ep=8, etp=1, pp=4, fused=True)
    expected = _on_disk_names_and_shapes(memory)
    assert len(expected) > 30_000  # 40 layers x 256 experts x 3 tensors, and the rest
    assert {n: tuple(t.shape) for n, t in out.items()} == expected
    # A TP-2 / ETP-1 rank's local shapes, by hand: attention 16 -> 8 query heads, 2 -> 1 KV head.
    layout = ModelLayout(layers=((0, 3),), pre_process=False, post_process=False, vision=False)
    rules = param_rules(arch, layout, Ranks(1, 2, 3, 8, 0, 1), fused_experts=True)
    assert rules["decoder.layers.0.self_attention.linear_qkv.weight"].local_shape == ((2 * 8 + 2 * 1) * 256, 2048)
    assert rules["decoder.layers.0.mlp.experts.weight1"].local_shape == (32, 1024, 2048)
    gdn = param_rules(arch, ModelLayout(layers=((0, 0),), pre_process=False, post_process=False, vision=False),
                      Ranks(0, 2))
    assert gdn["decoder.layers.0.self_attention.in_proj.weight"].local_shape == (2 * 8 * 128 + 2 * 16 * 128 + 2 * 16, 2048)
    assert gdn["decoder.layers.0.self_attention.conv1d.weight"].local_shape == (2 * 8 * 128 + 16 * 128, 1, 4)


def test_native_model_load_then_export_is_bit_exact(tiny, tiny_ckpt):
    """load_hf_checkpoint into the built native model, export_hf_weights out of it: the checkpoint's tensors."""
    pytest.importorskip("megatron.core")
    from qwen35_helpers import megatron_on_cpu

    from slime.models.qwen3_5.config import qwen35_config_from_hf
    from slime.models.qwen3_5.model import Qwen35Model
    from slime.models.qwen3_5.weights import export_hf_weights, load_hf_checkpoint

    tensors, _ = tiny
    with megatron_on_cpu():
        config = qwen35_config_from_hf(tiny_ckpt, params_dtype=torch.float32, moe_token_dispatcher_type="allgather",
                                       use_cpu_initialization=True, perform_initialization=False)
        with torch.device("meta"):
            model = Qwen35Model(config)
        assert all(p.is_meta for p in model.parameters())
        load_hf_checkpoint(model, tiny_ckpt)
        assert model.decoder.layers[0].self_attention.A_log.dtype == torch.float32
        out = dict(export_hf_weights(model))
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_native_35b_a3b_parameters_match_the_rules_on_meta():
    """The native model of Qwen3.5-35B-A3B, built on the meta device, has exactly the rules' names and shapes."""
    pytest.importorskip("megatron.core")
    from qwen35_helpers import megatron_on_cpu
    from transformers import Qwen3_5MoeConfig

    from slime.models.qwen3_5.config import qwen35_config_from_hf
    from slime.models.qwen3_5.model import Qwen35Model
    from slime.models.qwen3_5.weights import model_rules

    with megatron_on_cpu():
        config = qwen35_config_from_hf(Qwen3_5MoeConfig().to_dict(), moe_token_dispatcher_type="allgather",
                                       use_cpu_initialization=True, perform_initialization=False)
        with torch.device("meta"):
            model = Qwen35Model(config)
        rules = model_rules(model, Ranks())
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert params == {n: r.local_shape for n, r in rules.items()}
    assert sum(p.numel() for p in model.parameters()) > 34e9

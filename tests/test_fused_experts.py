"""The CUDA-IPC weight sync's fused expert layout (``slime.weight_sync.fused_experts``) on CPU: the bytes of a
flattened bucket, read through the fused metadata, must be exactly transformers 5's in-memory fused experts."""

from __future__ import annotations

import json

import pytest
import torch

from slime.weight_sync.flattened import flatten, unflatten
from slime.weight_sync.fused_experts import checkpoint_num_experts, fused_layout
from scripts.harness.sglang_gpu import load_checkpoint_tensors


def _read(bucket, num_experts, align=16):
    ordered, metadata, total = fused_layout(bucket, num_experts, align=align)
    flat = flatten(ordered, align=align)
    assert flat.nbytes == total
    return dict(unflatten(flat.buffer, metadata)), [m.name for m in metadata], [n for n, _ in ordered]


def test_fused_bucket_reads_as_transformers_in_memory_experts(tiny_ckpt):
    """The reference is independent of our code: transformers' own loader fuses the checkpoint's experts."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    per_expert = load_checkpoint_tensors(tiny_ckpt, device="cpu", dtype=torch.float32)
    reference = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).state_dict()
    experts = checkpoint_num_experts(tiny_ckpt)
    layers = [k for k in reference if k.endswith(".mlp.experts.gate_up_proj")]
    assert layers and experts == reference[layers[0]].shape[0]

    read, names, _ = _read(list(per_expert.items()), experts)
    assert set(read) == set(reference)  # every per-expert name replaced by its layer's two fused ones
    assert len(names) == len(per_expert) - len(layers) * (3 * experts - 2)
    for name, tensor in reference.items():
        assert torch.equal(read[name], tensor), name


def _layer(prefix, experts, inter=4, hidden=8, dtype=torch.float32, skip=()):
    gen = torch.Generator().manual_seed(0)
    out = []
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            if (e, proj) not in skip:
                out.append((f"{prefix}.mlp.experts.{e}.{proj}.weight", torch.randn(shape, generator=gen, dtype=dtype)))
    return out


def test_fused_layer_keeps_its_place_and_the_other_tensors_theirs():
    before, after = ("model.layers.0.input_layernorm.weight", torch.ones(8)), ("lm_head.weight", torch.ones(3, 8))
    bucket = [before, *_layer("model.layers.0", 3), after]
    read, names, ordered = _read(bucket, 3)
    assert names == [before[0], after[0], "model.layers.0.mlp.experts.gate_up_proj",
                     "model.layers.0.mlp.experts.down_proj"]  # fused entries last (the order SGLang loads)
    tensors = dict(bucket)
    gate_up = read["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (3, 8, 8)  # [E, 2I, H]
    for e in range(3):  # by hand: expert e's gate rows, then its up rows
        assert torch.equal(gate_up[e, :4], tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(gate_up[e, 4:], tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(read["model.layers.0.mlp.experts.down_proj"][e],
                           tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"])
    assert ordered[0] == before[0] and ordered[-1] == after[0] and len(ordered) == len(bucket)


def test_no_per_expert_name_follows_a_fused_one():
    """SGLang 0.5.17 reads every expert name after the first fused one with its fused table, so a per-expert
    tensor there would be skipped: a bucket with a whole layer and part of another must list the part first."""
    from slime.weight_sync.fused_experts import EXPERT_WEIGHT

    whole = _layer("model.layers.0", 4)
    part = [(n, t) for n, t in _layer("model.layers.1", 4) if ".experts.3." not in n]  # expert 3 elsewhere
    read, names, _ = _read([*whole, *part], 4)
    first_fused = min(i for i, n in enumerate(names) if n.endswith((".gate_up_proj", ".down_proj")))
    assert not any(EXPERT_WEIGHT.match(n) for n in names[first_fused:])
    assert {n for n in names if EXPERT_WEIGHT.match(n)} == {n for n, _ in part}
    for name, tensor in part:
        assert torch.equal(read[name], tensor)


@pytest.mark.parametrize("case", ["part_of_the_experts", "one_projection_missing", "no_expert_count", "padding"])
def test_layers_that_cannot_be_fused_go_per_expert_unchanged(case):
    experts, align, bucket = 4, 16, _layer("model.layers.1", 4)
    if case == "part_of_the_experts":  # expert parallelism: this rank holds experts 0..1 of 4
        bucket = [(n, t) for n, t in bucket if int(n.split(".experts.")[1].split(".")[0]) < 2]
    elif case == "one_projection_missing":
        bucket = _layer("model.layers.1", 4, skip={(2, "up_proj")})
    elif case == "no_expert_count":
        experts = None
    else:  # 3 x 5 fp32 tensors are 60 bytes: 16-byte alignment leaves gaps between them
        bucket, align = _layer("model.layers.1", 4, inter=3, hidden=5), 16
    read, names, ordered = _read(bucket, experts, align=align)
    assert names == ordered == [n for n, _ in bucket]
    for name, tensor in bucket:
        assert torch.equal(read[name], tensor)


def test_checkpoint_num_experts(tmp_path, tiny_ckpt):
    assert checkpoint_num_experts(tiny_ckpt) == json.loads((tiny_ckpt / "config.json").read_text())[
        "text_config"]["num_experts"]
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))  # dense
    assert checkpoint_num_experts(tmp_path) is None
    assert checkpoint_num_experts(tmp_path / "missing") is None and checkpoint_num_experts(None) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 16}))
    assert checkpoint_num_experts(tmp_path) == 16

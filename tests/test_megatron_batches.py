"""The Megatron backend's packed micro-batches (layout worked out by hand) and the export groups of the
lockstep weight buckets (no process group needed).  The micro-batch plans: tests/test_backend_steps.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("megatron.core")

from slime.backends.megatron.backend import pack_micro_batch  # noqa: E402
from slime.backends.megatron.weight_export import group_index, num_groups  # noqa: E402
from slime.data.sample import Sample  # noqa: E402
from slime.models.qwen3_5.config import arch_from_hf_config  # noqa: E402
from tests.helpers import make_samples  # noqa: E402


@pytest.fixture(scope="module")
def arch(tiny_ckpt):
    return arch_from_hf_config(json.loads((tiny_ckpt / "config.json").read_text()))


def test_packed_layout_by_hand(tiny_ckpt, arch):
    samples = make_samples(tiny_ckpt, [3, 2], images=[True, False])
    samples[1].response_token_ids[0] = arch.image_token_id  # a generated placeholder id
    batch = pack_micro_batch(samples, [5, 7], arch, torch.device("cpu"), pad_to_multiple_of=8)
    p0, p1 = len(samples[0].prompt_token_ids), len(samples[1].prompt_token_ids)
    t0 = p0 + 3
    # Logits predicting the responses: sample 0 at P0-1 .. P0+1, sample 1 at t0+P1-1, t0+P1.
    assert batch.inputs.logit_index.tolist() == [p0 - 1, p0, p0 + 1, t0 + p1 - 1, t0 + p1]
    assert batch.targets.tolist() == samples[0].response_token_ids + samples[1].response_token_ids
    assert batch.loss_mask.tolist() == [float(m) for m in samples[0].loss_mask + samples[1].loss_mask]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.advantages.tolist() == pytest.approx([samples[0].advantage, samples[1].advantage])
    assert batch.indices == [5, 7]
    # Inputs: both documents end to end, padded to a multiple of 8 by one padding document.
    total = t0 + p1 + 2
    ids = batch.inputs.input_ids
    assert ids.numel() == -(-total // 8) * 8
    assert batch.inputs.cu_seqlens.tolist()[:3] == [0, t0, total]
    assert ids[:p0].tolist() == samples[0].prompt_token_ids
    assert ids[t0 + p1] == 0  # the placeholder id in the response is fed as token 0 (its target stays)
    assert batch.targets[3] == arch.image_token_id
    # Sample 0's image: its merged tokens are the prompt's placeholders, positions restart per document.
    assert batch.inputs.image_tokens_per_document[:2] == [int((ids[:t0] == arch.image_token_id).sum()), 0]
    assert batch.inputs.position_ids[:, t0].tolist() == [0, 0, 0]
    assert [r.tolist() for r in batch.split(torch.arange(5.0))] == [[0.0, 1.0, 2.0], [3.0, 4.0]]


def test_every_checkpoint_tensor_has_an_export_group_in_model_order(tiny_ckpt, arch):
    with safe_open(tiny_ckpt / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    groups = {n: group_index(n, arch) for n in names}
    assert set(groups.values()) <= set(range(num_groups(arch)))
    depth = arch.vision_config["depth"]
    assert groups["model.language_model.embed_tokens.weight"] == 0
    assert groups["model.visual.patch_embed.proj.weight"] == 1
    assert groups["model.visual.blocks.0.attn.qkv.weight"] == 2
    assert groups[next(n for n in names if n.startswith("model.visual.merger."))] == 2 + depth
    for layer in range(arch.num_layers):
        assert groups[f"model.language_model.layers.{layer}.input_layernorm.weight"] == 3 + depth + layer
    assert groups["lm_head.weight"] == groups["model.language_model.norm.weight"] == num_groups(arch) - 1


def test_main_params_pair_with_model_params_in_groups_that_mix_bf16_and_fp32():
    """megatron-core 0.16.1 indexes a group's main parameters by the model parameter's place in the gradient
    buffer, while the group lists fp32 model parameters first (H200: another parameter's state came back);
    DistributedAdam pairs them through the parallel lists the groups are built from."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from slime.backends.megatron.optimizer import DistributedAdam

    a16 = torch.nn.Parameter(torch.zeros(96, dtype=torch.bfloat16))  # e.g. a projection, bf16
    b32 = torch.nn.Parameter(torch.zeros(32))  # e.g. A_log, kept in fp32
    a_main, b_main = torch.zeros(96), b32.detach().view(-1)
    index, _ = DistributedOptimizer._build_optimizer_group_ranges(
        [{"params": [a16, b32]}], [{torch.bfloat16: [{"param_map": {a16: None, b32: None}}]}])
    group_params = [b_main, a_main]  # megatron-core's order: [*fp32 shards, *fp32 copies of the bf16 shards]
    assert group_params[index[b32][1]] is a_main  # megatron-core's own lookup: the wrong parameter
    part = SimpleNamespace(model_float16_groups=[[a16]], shard_fp32_from_float16_groups=[[a_main]],
                           model_fp32_groups=[[b32]], shard_fp32_groups=[[b_main]])
    assert DistributedAdam._main_param(part, b32) is b_main
    assert DistributedAdam._main_param(part, a16) is a_main

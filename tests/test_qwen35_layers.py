"""Pieces of the native Qwen3.5 model that run without megatron-core: packing index maps, MRoPE positions
against transformers' ``get_rope_index``, the image-feature scatter, and the Gated DeltaNet torch path
against transformers' GDN and a float64 recurrent reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from qwen35_helpers import geo3k_prompts, recurrent_gated_delta_rule_f64

from slime.models.qwen3_5.gdn import causal_conv1d_packed, chunk_gated_delta_rule_torch
from slime.models.qwen3_5.packing import PackedSequences, pack_sequences
from slime.models.qwen3_5.rope import (
    PositionError,
    apply_rotary,
    inv_frequencies,
    mrope_frequencies,
    mrope_position_ids,
    packed_position_ids,
)
from slime.models.qwen3_5.vision import ImageTokenMismatch, scatter_image_features

# ---------------------------------------------------------------------------------------------- packing


def test_packing_index_maps_by_hand():
    ids, packing = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])],
                                  pad_to_multiple_of=4, pad_value=0)
    assert ids.tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert packing.cu_seqlens.tolist() == [0, 3, 4, 6, 8] and packing.cu_seqlens.dtype == torch.int32
    assert (packing.max_seqlen, packing.num_padding, packing.num_sequences) == (3, 2, 4)
    assert packing.document_ids().tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert packing.positions().tolist() == [0, 1, 2, 0, 0, 1, 0, 1]
    batch = packing.to_batch(ids)
    assert batch.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0], [0, 0, 0]]
    assert torch.equal(packing.from_batch(batch), ids)
    assert [t.tolist() for t in packing.split(ids)] == [[5, 6, 7], [8], [9, 10], [0, 0]]


def test_packing_rejects_bad_lengths():
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        PackedSequences.from_lengths([3, 0])
    with pytest.raises(ValueError, match="zero sequences"):
        PackedSequences.from_lengths([])


# ---------------------------------------------------------------------------------------------- MRoPE


def test_positions_match_transformers_get_rope_index(realgeo):
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    from slime.data.processor import load_processor

    config = AutoConfig.from_pretrained(realgeo)
    prompts = geo3k_prompts(load_processor(realgeo), [0, 5])
    text = torch.arange(20, 57)
    documents = [torch.cat([p["input_ids"], torch.arange(30)]) for p in prompts] + [text]
    grids = [p["image_grid_thw"] for p in prompts] + [None]
    ours = packed_position_ids(documents, grids, image_token_id=config.image_token_id, spatial_merge_size=2,
                               video_token_id=config.video_token_id)
    ref = []
    for doc, grid in zip(documents, grids):
        ids = doc.view(1, -1)
        mm = (ids == config.image_token_id).int()
        pos, _ = Qwen3_5MoeModel.get_rope_index(type("M", (), {"config": config,
                                                                "get_vision_position_ids": Qwen3_5MoeModel.get_vision_position_ids})(),
                                                ids, mm, image_grid_thw=grid)
        ref.append(pos[:, 0])
    assert torch.equal(ours, torch.cat(ref, dim=1))
    assert ours.shape[1] == sum(d.numel() for d in documents)
    # Positions restart in every document, and image tokens span a 2-D grid (H != W rows).
    assert ours[:, prompts[0]["input_ids"].numel() + 30].tolist() == [0, 0, 0]
    assert (ours[1] != ours[2]).any()


def test_position_errors_name_the_sample():
    grid = torch.tensor([[1, 4, 6]])  # 6 merged tokens
    doc = torch.tensor([1, 2] + [99] * 5 + [3])
    with pytest.raises(PositionError, match=r"sample 1: image 0 has grid \(t=1, h=4, w=6\) = 6 merged tokens but 5"):
        packed_position_ids([torch.tensor([1, 2]), doc], [None, grid], image_token_id=99, spatial_merge_size=2)
    with pytest.raises(PositionError, match="sample 0: 1 images given but 0 runs"):
        mrope_position_ids(torch.tensor([1, 2]), grid, image_token_id=99, spatial_merge_size=2)


def test_interleaved_frequencies_and_rotation_match_transformers(realgeo):
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding, apply_rotary_pos_emb

    text = AutoConfig.from_pretrained(realgeo).text_config
    rope = Qwen3_5MoeTextRotaryEmbedding(text)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 500, (3, 50), generator=gen)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos.unsqueeze(1))  # [1, T, 64]
    freqs = mrope_frequencies(pos, inv_frequencies(64, 1e7), (11, 11, 10), True)
    assert torch.allclose(freqs.cos(), cos[0], atol=1e-6) and torch.allclose(freqs.sin(), sin[0], atol=1e-6)
    q = torch.randn(50, 8, 256, generator=gen)
    ref, _ = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), q.transpose(0, 1).unsqueeze(0), cos, sin)
    assert torch.allclose(apply_rotary(q, freqs), ref[0].transpose(0, 1), atol=1e-5)
    # Height and width drive frequencies 1, 4, ... and 2, 5, ...: the axis assignment by hand.
    one_h = torch.zeros(3, 1, dtype=torch.long)
    one_h[1] = 1
    f = mrope_frequencies(one_h, torch.ones(32), (11, 11, 10), True)[0, :32]
    assert f.nonzero().squeeze(-1).tolist() == list(range(1, 33, 3))


# ---------------------------------------------------------------------------------------------- vision scatter


def test_scatter_puts_features_in_order_and_names_the_bad_sample():
    emb = torch.zeros(7, 2)
    ids = torch.tensor([1, 9, 9, 2, 3, 9, 4])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    feats = torch.tensor([[1.0, 1], [2, 2], [3, 3]])
    out = scatter_image_features(emb, ids, feats, image_token_id=9, cu_seqlens=cu, tokens_per_document=[2, 1])
    assert out[:, 0].tolist() == [0, 1, 2, 0, 0, 3, 0]
    with pytest.raises(ImageTokenMismatch, match=r"sample 1: 1 <\|image_pad\|> tokens \(id 9\) but its images give 2"):
        scatter_image_features(emb, ids, feats, image_token_id=9, cu_seqlens=cu, tokens_per_document=[2, 2])
    with pytest.raises(ImageTokenMismatch, match="2 image feature rows for 3 image tokens"):
        scatter_image_features(emb, ids, feats[:2], image_token_id=9, cu_seqlens=cu, tokens_per_document=[2, 1])


# ---------------------------------------------------------------------------------------------- GDN


def _gdn_inputs(lengths, heads=4, dk=16, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = torch.randn(total, heads, dk, generator=gen), torch.randn(total, heads, dk, generator=gen)
    v = torch.randn(total, heads, dv, generator=gen)
    g = -torch.rand(total, heads, generator=gen) * 3
    beta = torch.rand(total, heads, generator=gen)
    return q, k, v, g, beta, PackedSequences.from_lengths(lengths)


def test_chunked_torch_path_matches_float64_recurrence_packed():
    q, k, v, g, beta, packing = _gdn_inputs([70, 1, 130, 64])
    ours = chunk_gated_delta_rule_torch(q, k, v, g, beta, packing)
    ref = recurrent_gated_delta_rule_f64(q, k, v, g, beta, packing.cu_seqlens)
    assert ((ours.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_chunked_torch_path_gradients_match_float64_recurrence():
    """Gradients of q, k, v, beta and of the decay parameter A_log (heads from slow to fast decay)."""
    q, k, v, _, beta, packing = _gdn_inputs([150, 41], heads=4, dk=32, dv=32, seed=2)
    a = torch.randn(q.shape[0], 4, generator=torch.Generator().manual_seed(3))
    w = torch.randn(q.shape[0], 4, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = {}
    for name, dtype in (("ours", torch.float32), ("ref", torch.float64)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, beta)]
        a_log = torch.tensor([0.02, 1.0, 8.0, 16.0], dtype=dtype).log().requires_grad_()
        g = -a_log.exp() * F.softplus(a.to(dtype))
        run = chunk_gated_delta_rule_torch if name == "ours" else (
            lambda *x: recurrent_gated_delta_rule_f64(*x[:5], packing.cu_seqlens))
        (run(*leaves[:3], g, leaves[3], packing).double() * w).sum().backward()
        grads[name] = [x.grad.double() for x in (*leaves, a_log)]
    for ours, ref in zip(grads["ours"], grads["ref"]):
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-4


def test_chunked_torch_path_packed_equals_per_document():
    q, k, v, g, beta, packing = _gdn_inputs([50, 129, 3], seed=1)
    packed = chunk_gated_delta_rule_torch(q, k, v, g, beta, packing)
    alone = [chunk_gated_delta_rule_torch(*(x[s:e] for x in (q, k, v, g, beta)), PackedSequences.from_lengths([e - s]))
             for s, e in zip(packing.cu_seqlens[:-1].tolist(), packing.cu_seqlens[1:].tolist())]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-6, rtol=0)


def test_conv_restarts_at_document_boundaries():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 6, generator=gen), torch.randn(6, 4, generator=gen)
    packing = PackedSequences.from_lengths([5, 7])
    ours = causal_conv1d_packed(x, w, packing.positions())
    ref = torch.cat([F.silu(F.conv1d(x[s:e].t()[None], w.unsqueeze(1), padding=3, groups=6)[0, :, : e - s]).t()
                     for s, e in ((0, 5), (5, 12))])
    assert torch.allclose(ours, ref, atol=1e-6)


def test_gdn_module_packed_matches_transformers_gdn_per_document(tiny_ckpt):
    """The native GatedDeltaNet (torch path), loaded through the weight rules from an HF GDN module,
    run on three packed documents, against the HF module run on each document alone (fp32)."""
    pytest.importorskip("megatron.core")
    from qwen35_helpers import megatron_on_cpu
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from slime.models.qwen3_5.config import arch_from_hf_config, transformer_config
    from slime.models.qwen3_5.gdn import GatedDeltaNet
    from slime.models.qwen3_5.model import Qwen35Inputs
    from slime.models.qwen3_5.hf_mapping import LM, ModelLayout, param_rules
    from slime.models.qwen3_5.weights import StateDictReader, read_rank_state

    config = AutoConfig.from_pretrained(tiny_ckpt)
    torch.manual_seed(0)
    hf = Qwen3_5MoeGatedDeltaNet(config.text_config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    arch = arch_from_hf_config(config.to_dict())
    hf_state = {f"{LM}.layers.0.linear_attn.{n}": t for n, t in hf.state_dict().items()}
    prefix = "decoder.layers.0.self_attention."
    rules = {n: r for n, r in param_rules(arch, ModelLayout(layers=((0, 0),), pre_process=False, post_process=False,
                                                            vision=False)).items() if n.startswith(prefix)}
    lengths = [90, 1, 40]
    x = torch.randn(sum(lengths), 1, arch.hidden_size)
    with megatron_on_cpu(), torch.no_grad():
        module = GatedDeltaNet(transformer_config(arch, params_dtype=torch.float32, use_cpu_initialization=True),
                               gdn_kernel="torch", conv_kernel="torch")
        state = read_rank_state(StateDictReader(hf_state), rules)
        module.load_state_dict({n[len(prefix):]: t for n, t in state.items()}, strict=False)
        assert {n for n, _ in module.named_parameters()} == {n[len(prefix):] for n in state}
        inputs = Qwen35Inputs(torch.zeros(sum(lengths), dtype=torch.long), None,
                              PackedSequences.from_lengths(lengths).cu_seqlens, max(lengths))
        packed, _ = module(x, packed_seq_params=inputs.packed_seq_params())
    bounds = [0, 90, 91, 131]
    with torch.no_grad():
        ref = torch.cat([hf(x[s:e].transpose(0, 1))[0] for s, e in zip(bounds[:-1], bounds[1:])])
    assert ((packed[:, 0] - ref).abs().max() / ref.abs().max()).item() < 1e-5

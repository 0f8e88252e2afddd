"""Routed experts: the sample's compact form and its checks (:mod:`slime.routing_replay`), SGLang's base64 answer
(:func:`slime.rollout.engines.sglang.generation.decode_routed_experts`), and replay in the transformers model
(:mod:`slime.routing_replay`): its own routes change nothing, other routes give a float64 hand computation of an
MoE block.  The native model's replay is in ``tests/test_qwen35_model.py``, the backends' in
``tests/test_megatron_backend.py``, the engines' capture in ``tests/test_hf_engine.py`` and
``tests/test_sglang_engine.py``, the parity check's in ``tests/test_parity.py``.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from slime.routing_replay import OWN_ROUTE, RouteError, RouteShape, check_routes, compact_routes, token_routes
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.engines.sglang.client import SGLangRequestError
from slime.rollout.engines.sglang.generation import (
    decode_routed_experts,
    generate_batch_payload,
    generate_payload,
    parse_generate_response,
)

SHAPE = RouteShape(num_layers=3, top_k=2, num_experts=8)


# ----------------------------------------------------------------------------- the compact form


def test_route_shape_of_a_config_and_the_uint8_limit():
    config = {"text_config": {"num_hidden_layers": 40, "num_experts_per_tok": 8, "num_experts": 256}}
    assert RouteShape.from_hf_config(config) == RouteShape(40, 8, 256, "config.json")
    assert RouteShape.from_hf_config({"num_hidden_layers": 2, "num_experts_per_tok": 1, "num_experts": 4}) == \
        RouteShape(2, 1, 4, "config.json")  # a text config: fields at the top level
    assert RouteShape.from_hf_config({"text_config": {"num_hidden_layers": 4}}) is None  # dense
    with pytest.raises(RouteError, match="ckpt/config.json has 257 experts per layer; routed experts are stored as "
                                         "uint8, which names at most 256"):
        RouteShape.from_hf_config({"num_hidden_layers": 2, "num_experts_per_tok": 8, "num_experts": 257},
                                  "ckpt/config.json")


def test_compact_and_check_routes_name_the_problem():
    ids = np.array([[[0, 7], [1, 2], [3, 4]]] * 4, dtype=np.int64)  # [4, 3, 2]
    routes = compact_routes(ids, SHAPE, "r")
    assert routes.dtype == np.uint8 and routes.tolist() == ids.tolist()
    check_routes(routes, prompt_len=3, response_len=2, shape=SHAPE, where="s")  # 3 + 2 - 1 rows
    with pytest.raises(RouteError, match=r"s: routed experts are uint8 \[4, 3, 2\], expected uint8 \[5, 3, 2\] "
                                         r"\(prompt 4 \+ response 2 - 1 positions, 3 layers, top-2\)"):
        check_routes(routes, 4, 2, SHAPE, "s")
    with pytest.raises(RouteError, match=r"expected uint8 \[4, 3, 2\]"):
        check_routes(ids, 3, 2, SHAPE, "s")  # int64: not the compact form
    with pytest.raises(RouteError, match=r"r: routed expert ids span 0..8, outside 0..7"):
        compact_routes(ids + (ids == 7), SHAPE, "r")
    with pytest.raises(RouteError, match=r"r: routed experts of shape \[4, 2, 3\], expected \[positions, 3 layers, "
                                         r"top-2\]"):
        compact_routes(ids.transpose(0, 2, 1), SHAPE, "r")
    wide = RouteShape(3, 2, 200)
    with pytest.raises(RouteError, match="s: routed expert id 199 >= the model's 8 experts"):
        check_routes(compact_routes(np.full((4, 3, 2), 199), wide, "w"), 3, 2, SHAPE, "s")


def test_token_routes_places_each_sample_at_its_start_and_the_model_routes_the_rest():
    a = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    b = np.full((3, 3, 2), 5, dtype=np.uint8)
    out = token_routes([a, b], starts=[0, 4], total=9, shape=SHAPE)
    assert out.dtype == np.int16 and out.shape == (9, 3, 2)
    expected = np.full((9, 3, 2), OWN_ROUTE)
    expected[0:2], expected[4:7] = a, b  # rows 2-3 (a's last token, nothing) and 7-8 stay the model's
    assert np.array_equal(out, expected)


# ----------------------------------------------------------------------------- SGLang's answer


def _answer(prompt_tokens: int, output_ids: list[int], routes: np.ndarray | None) -> dict:
    meta = {"finish_reason": {"type": "length"}, "prompt_tokens": prompt_tokens,
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids], "id": "parity:3#attempt-ab"}
    if routes is not None:  # SGLang 0.5.17's detokenizer: base64 of the int32 tensor's bytes
        meta["routed_experts"] = base64.b64encode(routes.astype(np.int32).tobytes()).decode("utf-8")
    return {"text": "x", "output_ids": output_ids, "meta_info": meta}


def test_sglang_routed_experts_decode_from_base64_int32():
    # prompt 4 + response 3 - 1 = 6 positions, 3 layers, top-2, ids written out by hand
    ids = np.array([[[l * 2 + k + p % 2 for k in range(2)] for l in range(3)] for p in range(6)], dtype=np.int32)
    assert ids[5].tolist() == [[1, 2], [3, 4], [5, 6]]
    out = parse_generate_response(_answer(4, [11, 12, 13], ids), "parity:3", SHAPE)
    assert out.routed_experts.dtype == np.uint8 and out.routed_experts.tolist() == ids.tolist()
    assert decode_routed_experts(_answer(4, [11, 12, 13], ids)["meta_info"]["routed_experts"], 6, SHAPE).tolist() \
        == ids.tolist()
    assert parse_generate_response(_answer(4, [11, 12, 13], ids), "parity:3").routed_experts is None  # not asked
    assert parse_generate_response(_answer(4, [11, 12, 13], None), "parity:3", SHAPE).routed_experts is None
    with pytest.raises(SGLangRequestError, match=r"/generate answer for rid parity:3: meta_info.routed_experts holds "
                                                 r"144 bytes, expected 7 positions \(prompt \+ response - 1\) x 3 "
                                                 r"layers x top-2 int32 = 168 bytes"):
        parse_generate_response(_answer(5, [11, 12, 13], ids), "parity:3", SHAPE)
    with pytest.raises(SGLangRequestError, match="parity:3: routed expert ids span 1..8, outside 0..7"):
        parse_generate_response(_answer(4, [11, 12, 13], ids + 1 + (ids == 6)), "parity:3", SHAPE)
    bad = _answer(4, [11, 12, 13], ids)
    bad["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(SGLangRequestError, match="meta_info.routed_experts is not base64"):
        parse_generate_response(bad, "parity:3", SHAPE)


def test_the_request_field_keeps_sglangs_name_and_is_one_value_in_a_batch():
    params = SamplingParams(max_new_tokens=4)
    asks, plain = GenerateRequest("a", [], params, return_routed_experts=True), GenerateRequest("b", [], params)
    assert generate_payload(asks)["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_payload(plain)
    assert generate_batch_payload([plain, asks])["return_routed_experts"] is True  # GenerateReqInput: one bool
    assert "return_routed_experts" not in generate_batch_payload([plain, plain])


# ----------------------------------------------------------------------------- replay in the transformers model


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


def test_replaying_the_models_own_routes_changes_nothing(hf_model):
    from qwen35_helpers import hf_forward_routes

    from slime.routing_replay import force_hf_routes

    ids = torch.randint(0, 1000, (2, 23), generator=torch.Generator().manual_seed(0))
    own = torch.stack([hf_forward_routes(hf_model, row)[0] for row in ids])  # [2, 23, L, k]
    with torch.no_grad():
        plain = hf_model(input_ids=ids).logits
        with force_hf_routes(hf_model, own.flatten(0, 1)):
            replayed = hf_model(input_ids=ids).logits
        half = own.flatten(0, 1).clone()
        half[::2] = OWN_ROUTE  # every other token routed by the model itself
        with force_hf_routes(hf_model, half):
            mixed = hf_model(input_ids=ids).logits
    assert torch.equal(replayed, plain) and torch.equal(mixed, plain)


def test_replaying_other_routes_is_the_moe_block_by_hand(hf_model):
    from qwen35_helpers import moe_block_f64

    from slime.routing_replay import force_hf_routes, hf_moe_routers

    layers = len(hf_moe_routers(hf_model))
    block = hf_model.model.language_model.layers[1].mlp
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 12, block.gate.hidden_dim, generator=gen)
    num_experts, top_k = block.gate.num_experts, block.gate.top_k
    routes = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(12 * layers)])
    routes = routes.view(12, layers, top_k)
    with torch.no_grad(), force_hf_routes(hf_model, routes):
        got = block(x)[0]
    expected = moe_block_f64(block, x[0], routes[:, 1])
    own = block(x)[0].detach()  # without forcing: the router's own experts
    assert not torch.allclose(own.double(), expected, atol=1e-6)  # the forced experts are others
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_forced_gate_weights_are_differentiable_in_the_router_logits():
    from slime.routing_replay import forced_gate_weights

    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    experts = torch.tensor([[0, 3]])
    weights = forced_gate_weights(logits, experts)
    e = torch.exp(torch.tensor([1.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(weights.double(), (e / e.sum()).view(1, 2).to(weights.dtype).double())
    weights[0, 0].backward()
    # d w0 / d l0 = w0 (1 - w0), d w0 / d l3 = -w0 w1, others 0 (the renormalised softmax over experts 0 and 3)
    w0, w1 = (e / e.sum()).tolist()
    torch.testing.assert_close(logits.grad, torch.tensor([[w0 * (1 - w0), 0.0, 0.0, -w0 * w1]], dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)


def test_a_route_table_of_another_size_is_refused(hf_model):
    from slime.routing_replay import force_hf_routes

    ids = torch.arange(5).view(1, 5)
    with pytest.raises(ValueError, match="routes for 3 layers, the model has 4 MoE routers"):
        with force_hf_routes(hf_model, torch.zeros(5, 3, 2, dtype=torch.int64)):
            pass
    with pytest.raises(ValueError, match=r"replayed routes of shape \[4, 2\] for a router that routes \[5, 2\]"):
        with torch.no_grad(), force_hf_routes(hf_model, torch.zeros(4, 4, 2, dtype=torch.int64)):
            hf_model(input_ids=ids)
